"""The embedded PD router (``pdctl router``; started by ``pdctl up``).

Modules: ``app`` (RouterServer), ``config`` (settings and their flags, light: the planner
imports it), ``dispatch``, ``workers``, ``policies``, ``server``/``upstream`` (HTTP).
Nothing is imported here, so that ``pdctl.router.config`` costs the planner nothing more.
"""
