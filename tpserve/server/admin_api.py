"""Admin endpoints: live reconfiguration, statistics reset and profiler traces.

``POST /admin/config`` switches the active allreduce backend and the speculative settings
on every rank between two steps (no restart, in-flight requests continue under the new
setting), toggles the step profiler, and can reset the statistics. ``POST /admin/profile``
captures a ``torch.profiler`` trace of the next N engine steps on rank 0. Both sit behind
the admin key (``--admin-api-key``, default ``--api-key``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tpserve.engine.admin import AdminError
from tpserve.server.http import body_or_error, error, json_body
from tpserve.server.protocol import ErrorResponse
from tpserve.server.state import ServerState
from tpserve.server.trace_dir import NAME_RULE, TraceRequestError, check_name, trace_path


class SpeculativeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    num_steps: int | None = Field(None, ge=1, le=32)
    eagle_topk: int | None = Field(None, ge=1, le=16)
    num_draft_tokens: int | None = Field(None, ge=2, le=256)
    adaptive: bool | None = Field(None, description="true: the engine picks the setting per "
                                  "step (--speculative-adaptive); any other speculative setting "
                                  "given without it pins the settings")


class AdminConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    allreduce: str | None = Field(None, description="backend initialised at launch")
    speculative: SpeculativeSettings | None = None
    profiling: bool | None = Field(None, description="per-phase step timing on/off")
    reset_stats: bool = False


class ActiveSettings(BaseModel):
    allreduce: str | None
    speculative: dict[str, Any] | None
    profiling: bool


class ProfileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(10, ge=1, le=10000)
    name: str | None = Field(None, description=f"trace file name ({NAME_RULE}) inside the "
                             "private trace directory (--profile-dir)")
    wait_s: float = Field(0.0, ge=0.0, le=120.0,
                          description="wait up to this long for the trace to be written")


    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str | None) -> str | None:
        return None if name is None else check_name(name)


class ProfileResponse(BaseModel):
    path: str
    done: bool
    error: str | None = None


ADMIN_BODIES = (AdminConfig, SpeculativeSettings, ProfileRequest)


def _config_change(body: AdminConfig) -> dict[str, Any]:
    change: dict[str, Any] = body.model_dump(exclude_none=True)
    if body.speculative is not None:
        change["speculative"] = body.speculative.model_dump(exclude_none=True)
    return change


def register_admin(app: FastAPI, state: ServerState) -> None:
    errors: dict[int | str, dict[str, Any]] = {400: {"model": ErrorResponse}}

    @app.post("/admin/config", response_model=ActiveSettings, responses=errors,
              openapi_extra=json_body(AdminConfig))
    async def admin_config(raw: Request) -> Any:
        body = await body_or_error(raw, AdminConfig)
        if isinstance(body, JSONResponse):
            return body
        change = _config_change(body)
        result = await state.client.call(lambda eng: eng.reconfigure(change))
        if isinstance(result, AdminError):
            return error(400, str(result))
        if isinstance(result, Exception):
            return error(500, f"reconfiguration failed: {result}")
        return result

    @app.post("/admin/profile", response_model=ProfileResponse, responses=errors,
              openapi_extra=json_body(ProfileRequest))
    async def admin_profile(raw: Request) -> Any:
        body = await body_or_error(raw, ProfileRequest)
        if isinstance(body, JSONResponse):
            return body
        try:
            path = trace_path(state.args, body.name)
        except TraceRequestError as exc:
            return error(400, str(exc))
        capture = await state.client.call(lambda eng: eng.start_trace(body.steps, path))
        if isinstance(capture, Exception):
            return error(400, str(capture))
        deadline = time.monotonic() + body.wait_s
        while not capture.done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # steps only happen while requests are running
        return {"path": path, "done": capture.done, "error": capture.error}
