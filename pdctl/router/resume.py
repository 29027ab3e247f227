"""Continuing a /generate request on another pair: after its decode died mid-stream, or after a
weight update interrupted it (refit ``interrupt``, pdctl.refit).

SGLang's /generate answers (and each event of its stream) carry the cumulative ``text`` and
``output_ids`` with ``meta_info``. To continue an item the router asks an engine for the rest:
the item's prompt plus its tokens so far (``input_ids`` + ids for token prompts, text + text for
text prompts), for the tokens still owed, and shows the client the new answer behind what it
already has (``Piece.view``): text, ids, output logprobs, ``completion_tokens`` for the whole,
the first answer's prompt tokens, input logprobs and request id, and SGLang's
``weight_versions`` spans over the whole output (with the compact ``weight_version_spans``
beside them). Greedy requests continue exactly as they would have on the same weights; sampled
ones continue with a fresh draw.

What can be continued: ``/generate`` with ``text`` or ``input_ids`` prompts, single or batched,
any ``n``; not constrained decoding (a grammar would restart at the seam), nor a batch with other
per-item lists (``lora_path``, per-item ``return_logprob``, ...). A text prompt is continued as
text (prompt + text so far), which a tokenizer may split differently at the seam than the ids it
generated; token prompts continue exactly. A ``stop`` string split by the seam is not matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdctl.router.jsonutil import sse_data, sse_event

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
CONSTRAINED = ("regex", "json_schema", "ebnf", "structural_tag")
PROMPT_FIELDS = ("text", "input_ids", "sampling_params")
GENERATE = "/generate"


@dataclass(frozen=True)
class Job:
    """The client's request, item by item: the prompt and sampling params of answer ``k`` (SGLang
    orders a batch's answers prompt-major: prompt ``k // n``, sample ``k % n``)."""

    body: dict[str, Any]
    prompts: tuple[str | tuple[int, ...], ...]
    samplings: tuple[dict[str, Any], ...]
    n: int

    @classmethod
    def of(cls, path: str, body: dict[str, Any]) -> Job | None:
        """The job of a ``/generate`` body at ``path``; None when the request cannot be continued (module docstring)."""
        if path != GENERATE:
            return None
        text, ids = body.get("text"), body.get("input_ids")
        prompts: list[str | tuple[int, ...]]
        if isinstance(text, str) and ids is None:
            prompts = [text]
        elif isinstance(text, list) and ids is None and text and all(isinstance(t, str) for t in text):
            prompts = list(text)
        elif text is None and isinstance(ids, list) and _token_list(ids):
            prompts = [tuple(ids)]
        elif text is None and isinstance(ids, list) and ids and all(_token_list(i) for i in ids):
            prompts = [tuple(i) for i in ids]
        else:
            return None
        raw = body.get("sampling_params")
        if isinstance(raw, list):
            if len(raw) != len(prompts) or not all(isinstance(s, dict) for s in raw):
                return None
            samplings = [dict(s) for s in raw]
        elif raw is None or isinstance(raw, dict):
            samplings = [dict(raw or {}) for _ in prompts]
        else:
            return None
        n = samplings[0].get("n", 1)
        if n is None:
            n = 1
        if (
            not isinstance(n, int)
            or isinstance(n, bool)
            or n < 1
            or any(s.get("n", 1) not in (n, None) for s in samplings)
        ):
            return None
        if not all(_whole(s.get("max_new_tokens")) and _whole(s.get("min_new_tokens")) for s in samplings):
            return None
        if any(key in s for s in samplings for key in CONSTRAINED):
            return None  # a grammar would restart at the seam
        batched = isinstance(text, list) or _batched_ids(body)
        if batched and any(isinstance(v, list) for k, v in body.items() if k not in PROMPT_FIELDS):
            return None  # per-item fields (lora_path, return_logprob, ...) are not split per continued item
        return cls(body, tuple(prompts), tuple(samplings), n)

    @property
    def answers(self) -> int:
        """How many answers the request asks for: prompts x ``n``."""
        return len(self.prompts) * self.n

    @property
    def single(self) -> bool:
        """Whether the answer is one object (one prompt, one sample) rather than a list."""
        return self.answers == 1 and not isinstance(self.body.get("text"), list) and not _batched_ids(self.body)

    def wanted(self, k: int) -> int:
        """The ``max_new_tokens`` answer ``k`` asked for (SGLang's default when unset)."""
        value = self.samplings[k // self.n].get("max_new_tokens")
        return DEFAULT_MAX_NEW_TOKENS if value is None else int(value)

    def remaining(self, k: int, done: Piece) -> int:
        """The tokens answer ``k`` is still owed once it has ``done`` (negative when it has more than it asked for)."""
        return self.wanted(k) - done.tokens

    def continuation(self, items: list[tuple[int, Piece]]) -> dict[str, Any]:
        """One request for the rest of answers ``items`` ((index, what it has so far) pairs),
        as a batch when there are several; answers come back in ``items``' order."""
        prompts: list[Any] = []
        samplings = []
        for k, done in items:
            prompt = self.prompts[k // self.n]
            prompts.append(prompt + done.text if isinstance(prompt, str) else [*prompt, *done.ids])
            sampling = dict(self.samplings[k // self.n])
            sampling["n"] = 1
            sampling["max_new_tokens"] = self.remaining(k, done)
            if sampling.get("min_new_tokens"):
                sampling["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - done.tokens)
            samplings.append(sampling)
        body = {k: v for k, v in self.body.items() if k not in ("text", "input_ids", "rid", "sampling_params")}
        key = "text" if isinstance(self.prompts[0], str) else "input_ids"
        body[key] = prompts[0] if len(prompts) == 1 else prompts
        body["sampling_params"] = samplings[0] if len(samplings) == 1 else samplings
        if body.get("return_logprob"):
            body["logprob_start_len"] = -1  # the prompt's logprobs came with the first answer
        return body


@dataclass
class Piece:
    """What the client has of one answer so far (a whole answer or the last stream event it got)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    tokens: int = 0
    spans: list[dict[str, Any]] = field(default_factory=list)
    """SGLang's ``weight_versions`` over the output so far: ``{"version", "start", "end"}``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The first answer's meta_info: prompt tokens, input logprobs, request id."""
    output_logprobs: list[Any] | None = None
    output_top_logprobs: list[Any] | None = None
    interruptions: int = 0

    @classmethod
    def of(cls, item: dict[str, Any]) -> Piece | None:
        """The piece an answer (or cumulative stream event) shows; None if it shows none."""
        meta = item.get("meta_info")
        if not isinstance(meta, dict) or not isinstance(item.get("text"), str):
            return None
        raw_ids = item.get("output_ids")
        ids = list(raw_ids) if isinstance(raw_ids, list) else []
        tokens = int(meta.get("completion_tokens") or len(ids))
        spans = meta.get("weight_versions")
        if not (isinstance(spans, list) and all(isinstance(s, dict) for s in spans)):
            spans = [{"version": meta.get("weight_version"), "start": 0, "end": tokens}]
        return cls(
            text=item["text"],
            ids=ids,
            tokens=tokens,
            spans=[dict(s) for s in spans],
            meta={
                k: meta[k] for k in ("id", "prompt_tokens", "input_token_logprobs", "input_top_logprobs") if k in meta
            },
            output_logprobs=meta.get("output_token_logprobs"),
            output_top_logprobs=meta.get("output_top_logprobs"),
        )

    @property
    def versions(self) -> int:
        """How many weight versions the output so far came from."""
        return sum(1 for s in self.spans if s["end"] > s["start"])

    @property
    def version(self) -> str | None:
        """The weight version of the last span of output, or None with no output yet."""
        return self.spans[-1]["version"] if self.spans else None

    def view(self, item: dict[str, Any]) -> dict[str, Any]:
        """A continuation's answer (or event) as part of this one, as the client sees it."""
        return self._merge(item)[0]

    def advanced(self, item: dict[str, Any]) -> Piece:
        """What the client has once it got a continuation's answer (or event) ``item``."""
        merged, spans = self._merge(item)
        piece = Piece.of(merged) or Piece()
        piece.spans, piece.interruptions = spans, self.interruptions
        return piece

    def _merge(self, item: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        meta = item.get("meta_info")
        if not isinstance(meta, dict):
            return item, list(self.spans)
        out = dict(item)
        out["text"] = self.text + str(item.get("text", ""))
        out["output_ids"] = self.ids + list(item.get("output_ids") or [])
        meta = dict(meta)
        added = int(meta.get("completion_tokens") or len(item.get("output_ids") or []))
        meta["completion_tokens"] = self.tokens + added
        meta.update(self.meta)
        for key, have in (
            ("output_token_logprobs", self.output_logprobs),
            ("output_top_logprobs", self.output_top_logprobs),
        ):
            if have is not None or key in meta:
                meta[key] = list(have or []) + list(meta.get(key) or [])
        if self.interruptions:
            meta["pdctl_interruptions"] = self.interruptions
        theirs = meta.get("weight_versions")
        if not (isinstance(theirs, list) and all(isinstance(s, dict) for s in theirs)):
            theirs = [{"version": meta.get("weight_version"), "start": 0, "end": added}]
        spans = join_spans(self.spans, theirs, self.tokens)
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "length" and isinstance(reason.get("length"), int):
            meta["finish_reason"] = {**reason, "length": self.tokens + reason["length"]}  # the client's budget
        if reason is not None:  # the final answer: spans over the whole output
            meta["weight_versions"] = spans
            meta["weight_version_spans"] = compact_spans(spans)
            meta["weight_version"] = spans[-1]["version"]
        out["meta_info"] = meta
        return out, spans

    def finished(self, reason: dict[str, Any]) -> dict[str, Any]:
        """This piece as a final answer that ends with ``reason`` (no more tokens)."""
        item: dict[str, Any] = {
            "text": "",
            "output_ids": [],
            "meta_info": {"finish_reason": reason, "completion_tokens": 0},
        }
        item["meta_info"]["weight_versions"] = [{"version": self.version, "start": 0, "end": 0}]
        item["meta_info"]["weight_version"] = self.version
        out = self.view(item)
        out["meta_info"]["finish_reason"] = reason  # as given: it speaks of the whole answer
        return out

    def rewrite(self, event: bytes) -> bytes:
        """A continuation's SSE event as part of the client's stream ([DONE] and errors pass)."""
        data = sse_data(event)
        if data is None or not isinstance(data.get("meta_info"), dict):
            return event
        return sse_event(self.view(data))


def settle(
    job: Job, interrupted: dict[int, Piece], max_staleness: int | None
) -> tuple[dict[int, Piece], dict[int, Any]]:
    """Answers that an update just interrupted, split into those to continue and those that end
    here (as final answers): past ``max_staleness`` (``finish_reason`` type "stale") or with
    their budget spent ("length")."""
    going: dict[int, Piece] = {}
    ended: dict[int, Any] = {}
    for k, done in interrupted.items():
        done.interruptions += 1
        if max_staleness is not None and done.versions > max_staleness:
            ended[k] = done.finished(stale_reason(max_staleness, done.versions))
        elif job.remaining(k, done) <= 0:
            ended[k] = done.finished({"type": "length", "length": job.wanted(k)})
        else:
            going[k] = done
    return going, ended


def join_spans(have: list[dict[str, Any]], more: list[dict[str, Any]], offset: int) -> list[dict[str, Any]]:
    """``have`` then ``more`` shifted by ``offset`` tokens, adjacent spans of one version merged
    and empty ones dropped (except a lone first span, as SGLang keeps it)."""
    out: list[dict[str, Any]] = []
    for span in [*have, *({**s, "start": s["start"] + offset, "end": s["end"] + offset} for s in more)]:
        if out and span["end"] <= span["start"]:
            continue
        if out and out[-1]["version"] == span["version"]:
            out[-1]["end"] = span["end"]
        elif out and out[-1]["end"] <= out[-1]["start"]:
            out[-1] = dict(span)
        else:
            out.append(dict(span))
    return out


def compact_spans(spans: list[dict[str, Any]]) -> list[list[Any]]:
    """SGLang's spans as ``[[version, n_tokens], ...]``."""
    return [[s["version"], s["end"] - s["start"]] for s in spans if s["end"] > s["start"]] or (
        [[spans[0]["version"], 0]] if spans else []
    )


def asked_abort(item: Any) -> bool:
    """Whether an answer ended in an abort that was asked for (SGLang: an abort with no status,
    as a pause in ``abort`` mode ends requests), not a failure."""
    meta = item.get("meta_info") if isinstance(item, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(reason, dict) and reason.get("type") == "abort" and reason.get("status_code") is None


def stale_reason(limit: int, versions: int) -> dict[str, Any]:
    return {
        "type": "stale",
        "message": f"the output spans {versions} weight version(s) and another update came; max_staleness is {limit}",
        "max_staleness": limit,
    }


def _token_list(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _batched_ids(body: dict[str, Any]) -> bool:
    ids = body.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _whole(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
