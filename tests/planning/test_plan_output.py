"""What ``autopar plan`` prints, and what users read off it: the memory features of each row, the
same plan for a model given by its dimensions or by its HuggingFace config, rankings that do not
contradict their rejections, and tables (the plan's, the program summary's, the measured steps')
that fit 120 columns, piped or not, with every number whole. Also the main job's throughput line.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

import autopar
from autopar.cli import main
from autopar.cli.render import plan_row, plan_table
from autopar.compiler.report import memory_per_rank, render_summary
from autopar.planning.cost.layout import Cluster
from autopar.planning.cost.models import get_model
from autopar.planning.drawing.tables import PIPED_WIDTH
from autopar.planning.search.planner import SearchSpace, search

WIDTH = 120


def _plan_json(capsys, *args: str) -> dict:
    rc = main(["plan", *args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out.get("error")
    return out


def _table_rows(text: str) -> list[list[str]]:
    """The rows of the first compact table in ``text`` (under its header's rule), as tokens; a
    wrapped prose cell's continuation lines (indented, not a row number) are left out."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("──"))
    rows = []
    for line in lines[rule + 1:]:
        tokens = line.split()
        if tokens and (tokens[0].isdigit() or tokens[0] == "paper"):
            rows.append(tokens)
        elif not tokens or not line[0].isspace():
            break
    return rows


# ------------------------------------------------------------------ the features of each row

def test_rows_say_whether_they_use_sequence_parallelism_and_the_distributed_optimizer(capsys):
    args = ["--model", "gpt-7.5b", "--gpus", "64", "--batch", "512", "--tp", "2", "--pp", "2", "--vp", "2",
            "--micro-batch", "1", "--schedule", "zbv", "--recompute", "layer", "--sequence-parallel", "search",
            "--distributed-optimizer", "search"]
    out = _plan_json(capsys, *args)
    flags = {(r["sequence_parallel"], r["distributed_optimizer"]) for r in out["ranked"]}
    assert flags == {(False, False), (True, False), (False, True), (True, True)}  # all four priced, told apart
    assert main(["plan", *args]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert len(rows) == len(out["ranked"])
    for tokens, r in zip(rows, out["ranked"]):
        # columns: # t p d v b m sched recomp SP DO ...
        assert tokens[9:11] == ["on" if r["sequence_parallel"] else "-", "on" if r["distributed_optimizer"] else "-"]
        assert float(tokens[11]) == pytest.approx(r["iteration_s"], abs=5e-4)


# ------------------------------------------------- dimensions or a HuggingFace config: one plan

def _save(config, directory: Path) -> str:
    config.save_pretrained(directory)
    return str(directory)


def _configs(tmp_path):
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Config(n_layer=8, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)
    llama = dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816, vocab_size=32000, max_position_embeddings=1024)
    dims_llama = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--ffn", "2816",
                  "--gated-mlp", "--vocab", "32000"]
    return {
        # GPT-2: GeLU 4h MLP, dropout 0.1, sdpa (fused), head tied to the embedding, learned positions
        "gpt2": (_save(gpt2, tmp_path / "gpt2"), ["--layers", "8", "--hidden", "1024", "--heads", "16", "--vocab",
                                                   "50257", "--dropout", "--tied-head", "--learned-positions"]),
        # Llama: SwiGLU, grouped-query attention, no dropout, untied head, rotary: the flags' defaults
        "llama": (_save(transformers.LlamaConfig(**llama), tmp_path / "llama"), dims_llama),
        "llama tied": (_save(transformers.LlamaConfig(**llama, tie_word_embeddings=True), tmp_path / "tied"),
                       [*dims_llama, "--tied-head"]),
    }


def test_a_config_and_its_dimensions_get_the_same_plan(tmp_path, capsys):
    cluster = ["--gpus", "16", "--batch", "64", "--seq-len", "1024", "--top", "6"]
    plans = {}
    for name, (path, dims) in _configs(tmp_path).items():
        from_config = _plan_json(capsys, "--hf-config", path, *cluster)
        from_dims = _plan_json(capsys, *dims, *cluster)
        model = {k: v for k, v in from_config["model"].items() if k != "name"}
        assert model == {k: v for k, v in from_dims["model"].items() if k != "name"}, name
        # the config's activations are counted on its graph (ModelSpec.saved), the flags' by the formulas:
        # the same layouts and times, the memory their own
        memory = {"model", "memory_gib", "memory_breakdown_gib"}
        strip = lambda rows: [{k: v for k, v in r.items() if k not in memory} for r in rows]  # noqa: E731
        assert strip(from_config["ranked"]) == strip(from_dims["ranked"]), name
        assert from_config["rejected"] == from_dims["rejected"], name
        plans[name] = from_config
    assert plans["gpt2"]["model"]["tied_head"] and plans["gpt2"]["model"]["learned_positions"]
    assert plans["gpt2"]["model"]["dropout"] and plans["gpt2"]["model"]["fused_attention"]
    assert not plans["llama"]["model"]["tied_head"] and plans["llama tied"]["model"]["tied_head"]
    # the untied head is V h parameters more: on one stage (p = 1) its weights weigh more
    one = {n: next(r for r in p["ranked"] if (r["p"], r["t"], r["b"], r["recompute"]) == (1, 1, 1, "none"))
           for n, p in plans.items() if n != "gpt2"}
    extra = (one["llama"]["memory_breakdown_gib"]["weights"] - one["llama tied"]["memory_breakdown_gib"]["weights"])
    assert extra * 2**30 == pytest.approx(2 * 32000 * 1024)  # fp16 weights, V h of them


def test_flags_the_graph_answers_are_refused_with_a_config(tmp_path):
    path, _ = _configs(tmp_path)["llama"]
    with pytest.raises(SystemExit, match=r"--hf-config reads the model from its graph; --ffn, --tied-head would be"):
        main(["plan", "--hf-config", path, "--gpus", "16", "--batch", "64", "--ffn", "4096", "--tied-head"])


# ---------------------------------------------------------- m < p: ranked, and not rejected

def test_a_best_with_fewer_microbatches_than_stages_is_not_also_rejected_for_it(capsys):
    spec, cluster = get_model("gpt-39b"), Cluster.of(512, "dgx-a100-80gb", 16)
    plan = search(spec, cluster, SearchSpace(t=(8,), sequence_parallel=(False,), distributed_optimizer=(False,)))
    best = plan.best
    assert best.m < best.layout.p and best.runnable and best.layout.schedule == "1f1b"
    # rejections for m < p name the schedules whose rule it is, none of them the best's
    few = [rule for rule in plan.rejected if "m < p" in rule]
    assert few and all(rule.split(":")[0] in ("zb-h1", "zbv") for rule in few), plan.rejected
    assert "m < p" not in plan.rejected
    assert plan.notes() and f"m={best.m} microbatches on p={best.layout.p} stages" in plan.notes()[-1]
    assert main(["plan", "--model", "gpt-39b", "--gpus", "512", "--batch", "16", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())
    assert "x zb-h1: m < p" in words and " x m < p" not in words and " ".join(plan.notes()[-1].split()) in words
    assert "the rejections for m < p are zb-h1, zbv's rule (m >= p), not 1f1b's" in words


# ---------------------------------------------------------- tables: 120 columns, numbers whole

def _console(width: int | None) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width or PIPED_WIDTH, force_terminal=width is not None, color_system=None), buf


def _fits(text: str) -> None:
    long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not long, f"{len(long)} line(s) over {WIDTH} columns: {long[0]!r}"


@pytest.mark.parametrize("width", [WIDTH, None, 80], ids=["terminal-120", "piped", "terminal-80"])
def test_plan_table_fits_and_keeps_every_number(width):
    spec = get_model("gpt-39b")
    plan = search(spec, Cluster.of(512, "dgx-a100-80gb", 1536), SearchSpace(), top=10)
    assert plan.reference is not None  # a row more, and the longest schedule names
    console, buf = _console(width)
    console.print(plan_table(plan, 10), crop=False)  # as the CLI prints it
    text = buf.getvalue()
    if width != 80:
        _fits(text)
    # narrower than the table: its rows run on past the terminal's edge (which wraps them), never cut
    rows = _table_rows(text)
    want = [[str(k), *plan_row(e)] for k, e in enumerate(plan.ranked[:10], 1)] + [["paper", *plan_row(plan.reference)]]
    assert rows == want  # every cell whole, on one line, in its own column


def test_cli_output_fits_120_columns_piped(capsys):
    assert main(["plan", "--model", "gpt-39b", "--gpus", "512", "--batch", "1536", "--tp", "8", "--pp", "8",
                 "--micro-batch", "1", "--explain", "--vs-tp", "4", "--vs-pp", "4"]) == 0
    text = capsys.readouterr().out
    _fits(text)
    assert re.search(r"^\s+1\s+8\s+8\s+8\s", text, re.M)  # the fixed layout's row, each number whole
    assert main(["simulate", "--pp", "4", "--vp", "2", "--microbatches", "8", "--svg", ""]) == 0
    _fits(capsys.readouterr().out)


@pytest.mark.parametrize("width", [WIDTH, None], ids=["terminal-120", "piped"])
def test_program_summary_fits_and_keeps_every_number(width):
    from autopar.reference.models import build

    model = build("gpt", vocab_size=50304, seq_len=32, n_layer=4, n_head=4, d_model=64)
    x = torch.zeros(2, 32, dtype=torch.long)
    program = autopar.parallelize(model, tp=2, pp=2, virtual_stages=2, microbatches=4, example_inputs=(x,),
                                  example_targets=x, world_size=8)
    text = render_summary(program, width=width or PIPED_WIDTH)
    if width is None:
        assert text == program.summary()  # the default is the piped width
    _fits(text)
    from autopar.compiler.report import _gib

    stages = _table_rows(text[text.index("Pipeline stages"):])
    for s, m in enumerate(memory_per_rank(program)):
        row = " ".join(stages[s])
        for value in (f"{m['params']:,}", _gib(m["weights"]), _gib(m["grads"]), _gib(m["optimizer"]),
                      _gib(m["optimizer_distopt"]), _gib(m["activations"]), _gib(m["activations_sp"])):
            assert value in row, (value, row)
        assert stages[s][0] == str(s) and str(m["in_flight"]) in stages[s]


# ---------------------------------------------------------- the main job's throughput

def _train_script():
    path = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_progress_bar_and_last_line_report_throughput_alike():
    script = _train_script()
    # global tokens of one step over the median step time of the steps so far: 3 steps, median 0.5 s
    assert script.throughput(40960, [0.25, 2.0, 0.5]) == "81,920 tokens/s"
    assert script.throughput(40960, []) == "- tokens/s"

    class Args:
        micro_batch, microbatches, dp = 2, 4, 2

    assert script.step_tokens(Args) == 2 * 4 * 2 * script.CFG.seq_len
