"""Which of a tuned profile's measurements of a model priced a layout, in words: ``autopar plan``'s note
under its table and ``program.summary(hardware=...)``'s last line. A measurement prices a layout only
where it ran as the layout runs (eager chunks, the layout's t and sequence parallelism, no context
split); when none did, the note says which condition failed and what would measure it."""

from __future__ import annotations

from autopar.planning.cost.hardware import Hardware
from autopar.planning.cost.models import ModelSpec
from autopar.planning.cost.op_times import measured_this_layer, measures_layer_of
from autopar.core.config import SPLIT_BACKWARD_SCHEDULES
from autopar.planning.cost.step_estimate import Estimate, interleaved_send_extra, measured_pipeline_figure
from autopar.planning.quantities import seconds

__all__ = ["measured_note"]


def measured_note(spec: ModelSpec, hw: Hardware, best: Estimate, layout: str = "the best layout") -> str:
    """What of a tuned profile's measurements of a model (``layers``, ``data_parallel``, ``pipeline``) priced
    ``best`` (called ``layout`` in the text), or why none did; "" when the profile has none."""
    if not hw.layers and not hw.data_parallel and not hw.pipeline:
        return ""
    lay = best.layout
    fitted = not lay.fused_kernels and lay.cp == 1 and any(
        x.steps and (x.tp, x.sequence_parallel) == (lay.t, lay.sp) and measures_layer_of(x.signature, x.nodes, spec)
        for x in hw.layers)
    how = f" (fitted to the steps measured at t={lay.t})" if fitted else ""
    parts = [f"its layer x{best.layer_scale:.3g}{how}"] if best.layer_scale != 1.0 else []
    if best.data_parallel_scale != 1.0:
        parts.append(f"its gradient reduction x{best.data_parallel_scale:.3g}")
    extra = interleaved_send_extra(spec, hw, lay)
    if extra:
        parts.append(f"each interleaved send {'+' if extra > 0 else '-'}{seconds(abs(extra))} beyond a 1F1B send's")
    split = measured_pipeline_figure(spec, hw, lay) if lay.schedule in SPLIT_BACKWARD_SCHEDULES and lay.p > 1 else None
    if split is not None:
        parts.append(f"a split backward's pipeline part {seconds(split)} a chunk")
    if parts:
        return ("priced with this model's own measurements from `autopar tune` (measured over priced from the "
                "kernels): " + ", ".join(parts))
    if not measured_this_layer(spec, hw):
        measured = sorted({(x.signature, x.nodes) for x in (*hw.layers, *hw.data_parallel, *hw.pipeline)})
        ours = spec.graph_nodes[1] if spec.graph_nodes else 0
        what = ", ".join(sig + (f" ({nodes} graph nodes)" if sig == spec.layer_signature else "")
                         for sig, nodes in measured)
        return (f"the profile measured the layer of {what}, not this model's ({spec.layer_signature}"
                + (f", {ours} graph nodes" if ours else "") + "): its layer is priced from its kernels "
                "(`autopar tune` with this model's flags measures it)")
    runs = sorted({(x.tp, x.sequence_parallel) for x in hw.layers if measures_layer_of(x.signature, x.nodes, spec)})
    if lay.fused_kernels:
        why = (f"{layout} is priced with fused kernels (--kernels fused: compiled chunks), the measurement "
               "ran autopar's eager chunks (--kernels op-by-op prices them with it)")
    elif lay.cp > 1:
        why = f"{layout} splits the sequence (cp={lay.cp}), which the tune does not measure"
    else:
        said = ", ".join(f"t={t}" + (" with sequence parallelism" if sp else "") for t, sp in runs)
        why = (f"the tune measured it at {said}, not at t={lay.t}"
               + (" with sequence parallelism" if lay.sp else "") + f" (`autopar tune --nproc {lay.t}` or more "
               "ranks measures that degree)")
    return (f"the profile measured this model's layer, but not as {layout} runs it: {why}; its layer is priced "
            "from its kernels")
