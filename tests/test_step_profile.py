"""launch.step_profile on the demo model (CPU): the report the GPU gate prints per batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.step_profile import main, profile_decode
from tpserve.args import ServerArgs
from tpserve.offline import OfflineEngine

DEMO = Path(__file__).resolve().parents[1] / "tpserve" / "demo" / "target"


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    eng = OfflineEngine(ServerArgs(model=str(DEMO), device="cpu", max_running_requests=4,
                                   cpu_threads=1))
    yield eng
    eng.close()


def test_profile_reports_phases_and_host_calls_and_leaves_the_engine_idle(engine) -> None:  # type: ignore[no-untyped-def]
    before = engine.engine.profiler.enabled
    result = profile_decode(engine, batch=3, steps=5)
    assert result.batch == 3 and result.steps == 5 and result.device == "cpu"
    assert result.wall_ms > 0 and result.profiled_wall_ms > 0
    assert result.device_ms is None  # kernels are timed on CUDA only
    # the decode forward and the plan are phases of every plain decode step
    assert {"decode", "plan", "sample", "output"} <= set(result.phases_ms)
    assert result.phases_ms["decode"] > 0
    assert result.phase_coverage is not None and 0.5 < result.phase_coverage <= 1.01
    names = [c.name for c in result.top_host]
    assert names and all(c.calls_per_step > 0 for c in result.top_host)
    # the layer stack runs once per step whichever path it takes
    assert any(n.startswith(("tpserve::", "aten::")) for n in names)
    assert not engine.engine.scheduler.has_work()
    assert engine.engine.profiler.enabled == before
    text = "\n".join(result.lines())
    assert "ms/step (no profiler)" in text and "phases ms/step" in text


def test_too_few_tokens_is_a_clear_error(engine) -> None:  # type: ignore[no-untyped-def]
    from launch.step_profile import _decode, _start

    _start(engine, 1, 2)  # tokens for two more decode steps
    with pytest.raises(RuntimeError, match="finished before"):
        _decode(engine, 10)
    assert not engine.engine.scheduler.has_work()


def test_command_line_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    main(["--model", str(DEMO), "--batch", "1", "--steps", "3", "--json", str(out)])
    assert '"wall_ms"' in out.read_text()
    assert "decode step profile: batch 1, 3 steps, cpu" in capsys.readouterr().out
