"""The allocation-mode DSL: AReaL's grammar (prior-art.md 1.1) extended for PD.

    expression := component ("+" component)*          # "+": separate GPU pools
    component  := single ("|" single)*                # "|": shared GPUs; binds tighter than "+"
    single     := BACKEND ["[" NAME "]"] ":" (dims | hybrid)
    dims       := (LETTER NUMBER)+                    # inference d t p; training d t p c e
    hybrid     := ["("] "attn" ":" dims "|" "ffn" ":" dims [")"]

``sglang[prefill]:d2t2 + sglang[decode]:d1t4 + fsdp[trainer]:d8`` is two PD groups and a
trainer. Inference components named ``prefill``/``decode`` (or ``prefill_*``/``decode_*``)
are PD groups, each with its own t and d (unlike AReaL PR #1364, which took the first
group's TP). The parser is pure and reports the 1-based column of every fault. Validation
runs after parsing, outside the parser (AReaL string-matches errors out of Lark; we don't).

Decision: a repeated dimension letter (``d2d4``) is an error here; AReaL silently keeps
the last one, which hides typos.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdctl.errors import AllocationError

INFERENCE_BACKENDS = ("sglang", "vllm")
TRAINING_BACKENDS = ("fsdp", "megatron", "archon")
INFERENCE_DIMS = "dtp"
TRAINING_DIMS = "dtpce"
ATTN_DIMS = "cdtp"
FFN_DIMS = "detp"
_HINTS = (
    '\nHints:\n1. use colons, not dots: "sglang:d4+fsdp:d4", not "sglang.d4+fsdp.d4".'
    "\n2. name components in brackets: sglang[prefill]:d2t2."
)


@dataclass(frozen=True)
class Dims:
    """Parallel sizes; missing letters are 1. World size is d*t*p*c (``e`` adds no GPUs)."""

    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1

    @property
    def world_size(self) -> int:
        """GPUs one instance takes: ``d * t * p * c``."""
        return self.d * self.t * self.p * self.c

    def __str__(self) -> str:
        return "".join(f"{k}{getattr(self, k)}" for k in "dtpce" if getattr(self, k) != 1) or "d1"


@dataclass(frozen=True)
class MoEDims:
    """Hybrid MoE parallelism: attention and FFN (expert) modules sized separately."""

    attn: Dims
    ffn: Dims

    @property
    def world_size(self) -> int:
        """The attention dims' world size; the FFN dims are not counted."""
        return self.attn.world_size


@dataclass(frozen=True)
class Component:
    """One ``backend[name]:dims`` term. ``col`` is its 1-based start column."""

    backend: str
    name: str | None
    dims: Dims | MoEDims
    col: int

    @property
    def is_inference(self) -> bool:
        """True for an inference backend (``sglang``, ``vllm``)."""
        return self.backend in INFERENCE_BACKENDS

    @property
    def world_size(self) -> int:
        """Its dims' world size."""
        return self.dims.world_size

    @property
    def pd_role(self) -> str | None:
        """``prefill`` / ``decode`` for PD groups, None for other components."""
        if not self.is_inference or self.name is None:
            return None
        for role in ("prefill", "decode"):
            if self.name == role or self.name.startswith(f"{role}_"):
                return role
        return None


@dataclass(frozen=True)
class Allocation:
    """Parsed DSL: ``pools`` are the ``+`` terms; each is a ``|`` chain, anchor first."""

    text: str
    pools: tuple[tuple[Component, ...], ...]

    @property
    def components(self) -> tuple[Component, ...]:
        """Every component of every pool, in order."""
        return tuple(c for pool in self.pools for c in pool)

    @property
    def world_size(self) -> int:
        """GPUs used: colocated components share their anchor's GPUs."""
        return sum(pool[0].world_size for pool in self.pools)

    def get(self, name: str) -> Component:
        """The component called ``name``; raises KeyError listing the names."""
        for comp in self.components:
            if comp.name == name:
                return comp
        names = ", ".join(c.name for c in self.components if c.name)
        raise KeyError(f"no component {name!r} in allocation; named: {names or 'none'}")


MAX_ALLOCATION_CHARS = 4096
MAX_DIM_DIGITS = 6


def parse_allocation(text: str) -> Allocation:
    """Parse and validate an allocation string. Raises AllocationError with a column."""
    if len(text) > MAX_ALLOCATION_CHARS:
        message = f"an allocation is at most {MAX_ALLOCATION_CHARS} characters, this one {len(text)}"
        raise AllocationError(message, "", 1)
    alloc = _Parser(text).parse()
    _validate(alloc)
    return alloc


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    # -- scanning ------------------------------------------------------------------
    def fail(self, message: str, pos: int | None = None, hints: bool = False) -> AllocationError:
        at = self.pos if pos is None else pos
        return AllocationError(message + (_HINTS if hints else ""), self.text, at + 1)

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip_ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str, what: str) -> None:
        if self.peek() != char:
            found = repr(self.text[self.pos]) if self.pos < len(self.text) else "end of string"
            raise self.fail(f"expected {char!r} {what}, found {found}", hints=True)
        self.pos += 1

    def word(self) -> tuple[str, int]:
        self.skip_ws()
        start = self.pos
        if self.pos < len(self.text) and (self.text[self.pos].isalpha() or self.text[self.pos] == "_"):
            self.pos += 1
            while self.pos < len(self.text) and (self.text[self.pos].isalnum() or self.text[self.pos] == "_"):
                self.pos += 1
        return self.text[start : self.pos], start

    def lookahead_word(self) -> str:
        saved = self.pos
        word, _ = self.word()
        self.pos = saved
        return word

    # -- grammar -------------------------------------------------------------------
    def parse(self) -> Allocation:
        if not self.text.strip():
            raise self.fail("allocation is empty", 0)
        pools = [self.component()]
        while self.peek() == "+":
            self.pos += 1
            pools.append(self.component())
        if self.peek():
            raise self.fail(f"unexpected {self.text[self.pos]!r}", hints=True)
        return Allocation(self.text, tuple(pools))

    def component(self) -> tuple[Component, ...]:
        chain = [self.single()]
        while self.peek() == "|":
            self.pos += 1
            chain.append(self.single())
        return tuple(chain)

    def single(self) -> Component:
        self.skip_ws()
        start = self.pos
        if self.peek() == "(" or self.lookahead_word() == "attn":
            raise self.fail(
                "Backend must be explicitly specified for hybrid MoE parallelism. Use e.g. "
                "'megatron:(attn:d1p12t4|ffn:d1p12e4)'. Auto-backend selection is no longer supported.",
                start,
            )
        if self.peek() == "[":
            raise self.fail("Backend must be explicitly specified, e.g. fsdp[actor]:d4.", start)
        backend, at = self.word()
        if not backend:
            found = repr(self.text[self.pos]) if self.pos < len(self.text) else "end of string"
            raise self.fail(f"expected a component like sglang:d2t4, found {found}", hints=True)
        if _looks_like_dims(backend) and self.peek() != "[" and self.peek() != ":":
            raise self.fail(f"Backend must be explicitly specified, e.g. sglang:{backend} or fsdp:{backend}.", at)
        if backend not in INFERENCE_BACKENDS + TRAINING_BACKENDS:
            known = ", ".join(INFERENCE_BACKENDS + TRAINING_BACKENDS)
            raise self.fail(f"unknown backend {backend!r}; choose from {known}", at)
        name = None
        if self.peek() == "[":
            self.pos += 1
            name, _ = self.word()
            if not name:
                raise self.fail("expected a name like [prefill] (letters, digits, _)")
            if self.peek() != "]":
                raise self.fail(f"expected ']' after name {name!r}")
            self.pos += 1
        self.expect(":", f"after {backend!r}")
        if backend in TRAINING_BACKENDS and (self.peek() == "(" or self.lookahead_word() == "attn"):
            return Component(backend, name, self.hybrid(), start + 1)
        allowed = INFERENCE_DIMS if backend in INFERENCE_BACKENDS else TRAINING_DIMS
        return Component(backend, name, Dims(**self.dims(allowed, backend)), start + 1)

    def hybrid(self) -> MoEDims:
        parens = self.peek() == "("
        if parens:
            self.pos += 1
        attn_word, at = self.word()
        if attn_word != "attn":
            raise self.fail("expected 'attn:' to open a hybrid MoE spec", at)
        self.expect(":", "after 'attn'")
        attn = self.dims(ATTN_DIMS, "attn")
        self.expect("|", "between the attn and ffn sections")
        ffn_word, at = self.word()
        if ffn_word != "ffn":
            raise self.fail("expected 'ffn:' after 'attn:...|'", at)
        self.expect(":", "after 'ffn'")
        ffn_start = self.pos
        ffn = self.dims(FFN_DIMS, "ffn")
        if parens:
            self.expect(")", "to close the hybrid MoE spec")
        return _resolve_moe(attn, ffn, self, ffn_start)

    def dims(self, allowed: str, owner: str) -> dict[str, int]:
        out: dict[str, int] = {}
        self.skip_ws()
        while self.pos < len(self.text) and self.text[self.pos].isalpha():
            letter_at = self.pos
            letter = self.text[self.pos]
            if letter not in allowed:
                raise self.fail(f"{owner} takes dimensions {', '.join(allowed)}; {letter!r} is not one", letter_at)
            self.pos += 1
            num_at = self.pos
            while self.pos < len(self.text) and self.text[self.pos] in "0123456789":  # ASCII only: not '²'
                self.pos += 1
            digits = self.text[num_at : self.pos]
            if not digits or digits[0] == "0":
                raise self.fail(f"dimension {letter!r} needs a positive number without leading zeros", num_at)
            if len(digits) > MAX_DIM_DIGITS:
                raise self.fail(f"dimension {letter!r} is larger than any cluster ({digits[:12]}...)", num_at)
            if letter in out:
                raise self.fail(f"dimension {letter!r} given twice", letter_at)
            out[letter] = int(digits)
            self.skip_ws()
        if not out:
            raise self.fail(f"{owner} needs dimensions like d2t4", hints=True)
        return out


def _looks_like_dims(word: str) -> bool:
    import re

    return re.fullmatch(r"(?:[a-z][0-9]+)+", word) is not None


def _resolve_moe(attn: dict[str, int], ffn: dict[str, int], parser: _Parser, ffn_at: int) -> MoEDims:
    a = Dims(**attn)
    if "p" in ffn and ffn["p"] != a.p:
        raise parser.fail(
            f"Pipeline parallel size for attention and FFN modules must be identical. attn p={a.p}, ffn p={ffn['p']}.",
            ffn_at,
        )
    ffn.setdefault("p", a.p)
    if "d" not in ffn:
        denom = ffn.get("e", 1) * ffn.get("t", 1) * ffn["p"]
        if a.world_size % denom:
            raise parser.fail(
                f"Cannot derive expert dp: attention world size {a.world_size} is not divisible by e*t*p = {denom}.",
                ffn_at,
            )
        ffn["d"] = a.world_size // denom
    f = Dims(**ffn)
    ffn_world = f.d * f.e * f.t * f.p
    if ffn_world != a.world_size:
        raise parser.fail(
            "World size for expert modules and attention modules must be identical. "
            f"attn {a.world_size}, ffn {ffn_world}.",
            ffn_at,
        )
    return MoEDims(attn=a, ffn=f)


def _validate(alloc: Allocation) -> None:
    def fail(message: str, comp: Component | None = None) -> AllocationError:
        return AllocationError(message, alloc.text, comp.col if comp else 1)

    comps = alloc.components
    for comp in comps:
        dims = comp.dims if isinstance(comp.dims, Dims) else comp.dims.attn
        if comp.backend == "fsdp":
            ffn = comp.dims.ffn if isinstance(comp.dims, MoEDims) else dims
            if dims.p > 1 or ffn.e > 1:
                raise fail(f"FSDP backend only supports data/tensor/context parallelism. Got strategy: {dims}", comp)
        megatron_ep = comp.backend == "megatron" and isinstance(comp.dims, Dims) and dims.e > 1
        if megatron_ep and dims.world_size % (dims.p * dims.e):
            raise fail(f"Expert model parallel size {dims.e} cannot divide world size {dims.world_size}", comp)
    for pool in alloc.pools:
        anchor = pool[0]
        for other in pool[1:]:
            if other.name is None:
                raise fail("Components in colocation group must have names", other)
            if other.world_size != anchor.world_size:
                raise fail(
                    "Colocated components must have matching world sizes. "
                    f"'{anchor.name or anchor.backend}' has {anchor.world_size}, "
                    f"'{other.name}' has {other.world_size}.",
                    other,
                )
    # AReaL counts every component of a `+` chain, colocated ones included (its colocation
    # groups are checked first, as its parser builds them before the chain).
    unnamed = [c for c in comps if c.name is None]
    if len(alloc.pools) >= 2 and len(comps) >= 3 and unnamed:
        message = f"When using 3+ components, all must have names. Found {len(unnamed)} unnamed components."
        raise fail(message, unnamed[0])
    seen: set[str] = set()
    for comp in comps:
        if comp.name is not None:
            if comp.name in seen:
                raise fail(f"Duplicate component name: {comp.name}", comp)
            seen.add(comp.name)
