"""scripts/bench_compile.py: the order cells run in (the bars first), the shapes cut to fewer layers
and the linear extrapolation to the full layer count. The cells themselves run on the GPU host."""

import importlib.util
import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


@pytest.fixture(scope="module")
def bc():
    sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location("bench_compile", os.path.join(SCRIPTS, "bench_compile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_first_shape_runs_every_method_then_ar_everywhere_then_the_rest(bc):
    cells = bc.ordered_cells(["a", "b"], ["ar", "chain", "tree"], ["auto", "1"])
    assert [(c["shape"], c["method"], c["unroll"]) for c in cells] == [
        ("a", "ar", "auto"), ("a", "ar", "1"), ("a", "chain", "auto"), ("a", "chain", "1"), ("a", "tree", "auto"),
        ("a", "tree", "1"), ("b", "ar", "auto"), ("b", "ar", "1"), ("b", "chain", "auto"), ("b", "chain", "1"),
        ("b", "tree", "auto"), ("b", "tree", "1")]


def test_shapes_cut_to_fewer_layers_and_unroll_values(bc):
    name, cfg = bc.parse_shape("llama-3.1-70b:8")
    assert (name, cfg.num_layers, cfg.hidden_size) == ("llama-3.1-70b", 8, 8192)
    assert bc.parse_shape("smollm2-135m")[1].num_layers == 30
    assert [bc.unroll_value(u) for u in ("auto", "true", "1", "5")] == [None, True, 1, 5]


def test_cut_shapes_extrapolate_to_their_full_depth(bc):
    def row(layers, first, cached, unroll="auto"):
        return dict(shape=f"llama-3.1-70b:{layers}", method="ar", unroll=unroll, layers=layers, shape_layers=80,
                    first_total_s=first, cached_total_s=cached, card="cpu")

    rows = [row(8, 20.0, 2.0), row(16, 36.0, 3.0), row(8, 10.0, 1.0, "1"),  # one layer count: not extrapolated
            dict(row(30, 50.0, 4.0), shape="smollm2-135m", shape_layers=30)]  # a full shape: nothing to extrapolate
    (out,) = bc.extrapolated(rows)
    assert (out["shape"], out["unroll"], out["extrapolated_to"], out["from_layers"]) == ("llama-3.1-70b", "auto", 80, [8, 16])
    assert out["first_total_s"] == pytest.approx(164.0) and out["first_s_per_layer"] == pytest.approx(2.0)
    assert out["cached_total_s"] == pytest.approx(11.0)


def test_a_flat_or_falling_cost_is_not_extrapolated_below_what_was_measured(bc):
    """Two cuts where the deeper one compiled faster (noise over a flat cost) give the slowest cut's
    seconds and no growth per layer, not a line run down past zero at the full depth."""
    rows = [dict(shape=f"llama-3.1-70b:{n}", method="chain", unroll="auto", layers=n, shape_layers=80,
                 first_total_s=first, cached_total_s=cached, card="cpu")
            for n, first, cached in ((8, 8.6, 1.6), (16, 7.7, 1.2))]
    (out,) = bc.extrapolated(rows)
    assert (out["first_total_s"], out["first_s_per_layer"]) == (8.6, 0.0)
    assert (out["cached_total_s"], out["cached_s_per_layer"]) == (1.6, 0.0)
