"""SGLang's control routes answered for the whole fleet (pdctl.router.facade.facade)."""

from pdctl.router.facade.facade import SGLangFacade

__all__ = ["SGLangFacade"]
