"""A request's sampling fields turned into engine requests, for every generating API.

The fields are OpenAI's (``temperature``, ``top_p``, ``seed``, ``stop``, ``logit_bias``,
``logprobs``, ``max_tokens`` / ``max_completion_tokens``, ``response_format``) plus the
extras vLLM accepts on the same endpoints (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``structured_outputs`` and the ``guided_*`` fields);
:mod:`.protocol` declares them once in ``_SamplingFields``. Here they are checked, filled
from the model's ``generation_config.json`` where the request leaves them unset, and
turned into one :class:`~mlx_ferrum.engine.SamplingParams` per choice; an invalid value
is a 400 naming the field. Chat (:mod:`.translation`) and completions
(:mod:`.completions`) both plan their engine requests through :func:`engine_requests`.
"""

from __future__ import annotations

import re
from typing import Optional

from ..engine import SamplingParams
from ..engine.engine import context_full_message
from ..engine.structured import StructuredOutputsParams
from ..errors import SamplingParamsError, StructuredOutputError
from . import protocol as p
from .serving import OpenAIServing, ServingError

__all__ = ["TOP_LOGPROBS_MAX", "EngineRequest", "check_unimplemented", "output_constraint", "constraint_fields",
           "engine_requests"]

#: OpenAI's bound on ``top_logprobs`` (chat) and ``logprobs`` (completions).
TOP_LOGPROBS_MAX = 20
_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")

#: One planned engine request: ``(prompt index, prompt ids, SamplingParams)``.
EngineRequest = tuple[int, list[int], SamplingParams]


def _refuse_field(name: str, why: str) -> ServingError:
    return ServingError(400, f"'{name}' is not supported by this server ({why}): remove it from the request", param=name)


def check_unimplemented(req: p._SamplingFields) -> None:
    """Refuse, by name, an OpenAI field whose meaning the server does not implement.

    Raises:
        ServingError: 400 naming the field.
    """
    if req.audio is not None:
        raise _refuse_field("audio", "it generates text only")
    if req.modalities is not None and req.modalities != ["text"]:
        raise _refuse_field("modalities", "it generates text only; send [\"text\"] or leave it out")
    if isinstance(req, p.CompletionRequest):
        if req.suffix is not None:
            raise _refuse_field("suffix", "fill-in-the-middle is not implemented")
        if req.best_of is not None and req.best_of not in (1, req.n):
            raise _refuse_field("best_of", "it returns every choice it generates; leave best_of out or set it to n")
    if isinstance(req, p.ChatCompletionRequest):
        if req.functions is not None:
            raise _refuse_field("functions", "function calling is not implemented")
        if req.function_call is not None and req.function_call != "none":
            raise _refuse_field("function_call", "function calling is not implemented")


def output_constraint(req: p._SamplingFields) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's output constraint and the field that set it: OpenAI's
    ``response_format``, or one of vLLM's ``structured_outputs`` / ``guided_*`` fields.

    Raises:
        ServingError: 400 for a malformed ``response_format``, or more than one constraint.
    """
    found = []
    rf = req.response_format
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ServingError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                               "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                               param="response_format")
        if rf["type"] == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf["type"] == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ServingError(400, "response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": "
                                   "{a JSON schema object}}", param="response_format")
            found.append(("response_format", StructuredOutputsParams(json=schema)))
    try:
        if req.structured_outputs is not None:
            found.append(("structured_outputs", StructuredOutputsParams(**req.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                          ("guided_choice", "choice")):
            if getattr(req, name) is not None:
                found.append((name, StructuredOutputsParams(**{key: getattr(req, name)})))
    except (StructuredOutputError, TypeError) as e:
        raise ServingError(400, f"invalid constraint: {e}", param="structured_outputs") from None
    if len(found) > 1:
        raise ServingError(400, f"give one output constraint, got {[n for n, _ in found]}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def constraint_fields(serving: OpenAIServing, spec: Optional[StructuredOutputsParams], field: Optional[str]) -> dict:
    """``{"structured_outputs": spec}``, compiled once here (a worker thread; the engine
    reuses the compiled grammar), or ``{}`` without a constraint.

    Raises:
        ServingError: 400 naming ``field`` when the constraint does not compile.
    """
    if spec is None:
        return {}
    try:
        serving.engine.compile_constraint(SamplingParams(structured_outputs=spec))
    except StructuredOutputError as e:
        raise ServingError(400, str(e), param=field) from None
    return {"structured_outputs": spec}


def _logit_bias(raw: Optional[dict], vocab_size: int) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (``{"token id": bias}``) as ``{int: float}``, validated.

    Raises:
        ServingError: 400 for a key that is not a token id of the vocabulary, or a
            bias that is not a number in [-100, 100].
    """
    if not raw:
        return None
    out = {}
    for key, bias in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise ServingError(400, f"logit_bias key {key!r} is not a token id: use token ids as keys, e.g. {{\"50\": -100}}",
                               param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise ServingError(400, f"logit_bias key {key!r} is outside the vocabulary [0, {vocab_size}): use valid token ids",
                               param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ServingError(400, f"logit_bias[{key!r}]={bias!r} is invalid: use a number in [-100, 100]", param="logit_bias")
        out[tid] = float(bias)
    return out


def engine_requests(serving: OpenAIServing, req: p._SamplingFields, prompts: list[list[int]], max_tokens: Optional[int],
                    logprobs: Optional[int], extra: Optional[dict] = None) -> list[EngineRequest]:
    """``(prompt index, ids, params)`` for each of the ``n`` choices of each prompt;
    ``extra``: more :class:`SamplingParams` fields (prompt logprobs, a constraint).

    Raises:
        ServingError: 400 ``context_length_exceeded`` for a prompt that fills the
            context, 400 naming the field for an invalid sampling value.
    """
    for i, ids in enumerate(prompts):
        if len(ids) >= serving.max_model_len:
            # the engine would refuse it too, but only after checking every id on the event loop
            message = context_full_message(len(ids), serving.max_model_len, serving.engine.model.args.max_position_embeddings)
            raise ServingError(400, message if len(prompts) == 1 else f"prompt {i}: {message}", param="prompt",
                               code="context_length_exceeded")
    bias = _logit_bias(req.logit_bias, serving.vocab_size)
    return [(pi, ids, _sampling_params(serving, req, len(ids), max_tokens, logprobs, j, bias, extra))
            for pi, ids in enumerate(prompts) for j in range(req.n)]


def _sampling_params(serving: OpenAIServing, req: p._SamplingFields, prompt_len: int, max_tokens: Optional[int],
                     logprobs: Optional[int], choice: int, logit_bias: Optional[dict[int, float]] = None,
                     extra: Optional[dict] = None) -> SamplingParams:
    """Choice ``choice``'s parameters: request fields, else the model's defaults, else OpenAI's."""
    default = serving.sampling_defaults
    max_model_len = serving.max_model_len
    if max_tokens is None:
        max_tokens = max(1, max_model_len - prompt_len)
        if "max_tokens" in default:
            max_tokens = min(max_tokens, default["max_tokens"])
    elif prompt_len + max_tokens > max_model_len:
        # vLLM's policy: a limit the context cannot hold is refused, not silently cut
        # (leave the field out for the rest of the context)
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise ServingError(
            400, f"{name}={max_tokens} with a prompt of {prompt_len} tokens needs {prompt_len + max_tokens} tokens, "
            f"over the context of {max_model_len}: ask for at most {max_model_len - prompt_len}, or leave "
            f"{name} unset for the rest of the context", param=name)
    seed = req.seed
    if seed is not None and choice:
        seed = (seed + choice) % 2**64  # n choices of one seeded request differ, reproducibly
    fields = dict(
        temperature=default.get("temperature", 1.0) if req.temperature is None else req.temperature,
        top_p=default.get("top_p", 1.0) if req.top_p is None else req.top_p,
        top_k=default.get("top_k", 0) if req.top_k is None else req.top_k,
        min_p=default.get("min_p", 0.0) if req.min_p is None else req.min_p,
        repetition_penalty=(default.get("repetition_penalty", 1.0) if req.repetition_penalty is None
                            else req.repetition_penalty),
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        seed=seed,
        max_tokens=max_tokens,
        stop=req.stop if req.stop is not None else [],
        stop_token_ids=req.stop_token_ids or [],
        logprobs=logprobs,
        ignore_eos=req.ignore_eos,
        logit_bias=logit_bias,
    )
    fields.update(extra or {})
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as e:
        m = _PARAM_RE.search(str(e))
        raise ServingError(400, str(e), param=m.group(1) if m else None) from None
