"""The serving compile's graph passes (deeprec/serving/compile_passes.py), each alone on an ATen graph
(make_fx, as inductor's post-grad graph is ATen), then as the custom pass a package is compiled with."""
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from deeprec.serving.compile_passes import ServingPasses, unfuse_bias

aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _mlp(x, w1, b1, w2, b2, w3, b3):
    h = torch.relu(F.linear(x, w1, b1))  # addmm -> relu: unfused
    logits = F.linear(h, w2, b2)  # addmm -> sigmoid: unfused
    side = F.linear(h, w3, b3)  # addmm -> mm (not pointwise): kept
    return torch.sigmoid(logits), side @ side.t()


def _inputs():
    g = torch.Generator().manual_seed(0)
    # K = 512: MKL may split the sum in blocks and add the bias with the first (the order differs)
    shapes = [(64, 512), (256, 512), (256,), (8, 256), (8,), (16, 256), (16,)]
    return [torch.randn(*s, generator=g) / (s[-1] ** 0.5 if len(s) == 2 else 1) for s in shapes]  # Linear's scale


def test_unfuse_bias_turns_each_addmm_feeding_pointwise_ops_into_mm_plus_bias():
    args = _inputs()
    gm = make_fx(_mlp)(*args)
    assert _targets(gm).count(aten.addmm.default) == 3
    want = gm(*args)
    unfuse_bias(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(aten.addmm.default) == 1  # the one whose user is a GEMM
    assert targets.count(aten.mm.default) == 3 and targets.count(aten.add.Tensor) == 2
    for node in gm.graph.nodes:  # inductor lowers by the metadata: every new node carries it
        if node.target in (aten.mm.default, aten.add.Tensor):
            assert isinstance(node.meta.get("val"), torch.Tensor)
    (probabilities, gram), (want_probabilities, want_gram) = gm(*args), want
    # the bias added after the sum, not before: equal to float rounding (bit for bit on some CPUs)
    torch.testing.assert_close(probabilities, want_probabilities, rtol=0, atol=1e-6)
    torch.testing.assert_close(gram, want_gram, rtol=1e-4, atol=1e-3)


def test_unfuse_bias_keeps_scaled_half_precision_or_non_cpu_addmm():
    x, w, b = torch.randn(4, 8), torch.randn(8, 3), torch.randn(3)
    scaled = make_fx(lambda x, w, b: torch.relu(torch.addmm(b, x, w, beta=0.5)))(x, w, b)
    before = _targets(scaled)
    unfuse_bias(scaled.graph)
    assert _targets(scaled) == before  # beta != 1: a kwarg the rewrite does not carry
    in_bf16 = make_fx(lambda x, w, b: torch.relu(torch.addmm(b, x, w)))(x.bfloat16(), w.bfloat16(), b.bfloat16())
    unfuse_bias(in_bf16.graph)
    assert aten.addmm.default in _targets(in_bf16)  # mm would round the sum before the bias is added
    on_meta = make_fx(lambda x, w, b: torch.relu(torch.addmm(b, x, w)), tracing_mode="fake")(
        x.to("meta"), w.to("meta"), b.to("meta"))
    unfuse_bias(on_meta.graph)
    assert aten.addmm.default in _targets(on_meta)  # GPUs have inductor's own unfusing; other devices as they were


def test_serving_passes_run_every_pass_and_name_themselves_stably():
    args = _inputs()
    gm = make_fx(_mlp)(*args)
    ServingPasses()(gm.graph)
    assert _targets(gm).count(aten.addmm.default) == 1
    # the compile cache keys packages by the options' text: the same passes, the same text, no address
    assert repr(ServingPasses()) == repr(ServingPasses()) and ServingPasses().uuid() in repr(ServingPasses())


def test_packages_are_compiled_with_the_serving_passes():
    from deeprec.serving.compiled import compile_options

    options = compile_options()
    assert isinstance(options["post_grad_custom_post_pass"], ServingPasses)
    assert options is not compile_options()  # a dict of its own per compile: inductor adds entries to it
