"""Appending generated tokens to a request: stop conditions, detokenization, streaming.

Tokens are appended one at a time even when speculation accepts several at once, so that
EOS, stop strings and max_new_tokens landing mid-run stop exactly where plain decoding would.
"""

from __future__ import annotations

import time

from tpserve.engine.request import Request, RequestOutput


def append_tokens(req: Request, tokens: list[int], context_length: int,
                  logprobs: list | None = None) -> int:
    """Append ``tokens`` until the request finishes; returns how many were taken."""
    taken = 0
    for i, token in enumerate(tokens):
        if req.finished:
            break
        req.output_ids.append(token)
        if logprobs is not None and req.params.logprobs >= 0 and i < len(logprobs):
            req.logprobs.append(logprobs[i])
        taken += 1
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        _update_text(req)
        _check_finish(req, token, context_length)
    return taken


def _update_text(req: Request) -> None:
    if req.finished:
        return
    chunk = req.detok.add([req.output_ids[-1]])
    req.text += chunk
    match = req.stop.feed(chunk)  # O(len(chunk)), however many stop strings there are
    if match is not None:
        req.text = req.text[:match.start]
        req.finish_reason = {"type": "stop", "matched": match.stop}


def _check_finish(req: Request, token: int, context_length: int) -> None:
    if req.finished:
        return
    params = req.params
    enough = len(req.output_ids) >= params.min_new_tokens
    if enough and token in params.stop_token_set:
        req.finish_reason = {"type": "stop", "matched": token}
    elif enough and not params.ignore_eos and token in req.eos_ids:
        req.finish_reason = {"type": "stop", "matched": token}
    elif len(req.output_ids) >= params.max_new_tokens:
        req.finish_reason = {"type": "length", "length": params.max_new_tokens}
    elif req.seq_len >= context_length:
        req.finish_reason = {"type": "length", "length": len(req.output_ids)}
    if req.finished:
        req.text += req.detok.finish() if req.finish_reason.get("type") != "stop" or not isinstance(
            req.finish_reason.get("matched"), str) else ""


def emit_progress(req: Request) -> None:
    """Send what is new since the last event (holding back a possible stop-string prefix);
    for a request that is not streamed, only its first event and its final one. Nothing
    after the final event (an abort can follow a finish whose event was still pending)."""
    if req.final_sent or not req.stream and not req.finished and req.streamed_ids:
        return
    visible = len(req.text) if req.finished else len(req.text) - req.stop.held
    new_text = req.text[req.streamed_text : visible]
    new_ids = req.output_ids[req.streamed_ids :]
    if not new_text and not new_ids and not req.finished:
        return
    req.streamed_text = max(req.streamed_text, visible)
    req.streamed_ids = len(req.output_ids)
    req.emit(RequestOutput(
        rid=req.rid, text=req.text[:visible], new_text=new_text, output_ids=list(req.output_ids),
        new_ids=new_ids, finished=req.finished, finish_reason=req.finish_reason,
        meta=req.meta(), logprobs=list(req.logprobs),
    ))
    req.final_sent = req.finished


def abort(req: Request, message: str = "aborted") -> None:
    if not req.finished:
        req.finish_reason = {"type": "abort", "message": message}
    emit_progress(req)


def fail_request(req: Request, message: str) -> None:
    """Finish ``req`` with an error. Its final event is built without the detokenizer or the
    stop matcher (either may be what failed), from the text already streamed."""
    if req.final_sent:
        return
    req.finish_reason = {"type": "abort", "message": message}
    req.emit(RequestOutput(
        rid=req.rid, text=req.text[: req.streamed_text], new_text="",
        output_ids=list(req.output_ids), new_ids=req.output_ids[req.streamed_ids :],
        finished=True, finish_reason=req.finish_reason, meta=req.meta(),
        logprobs=list(req.logprobs)))
    req.final_sent = True
