"""autocast_context(): CUDA autocast's op lists on CPU tensors, versus torch's CPU autocast."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from lab.precision.autocast import (
    AUTOCAST_POLICIES,
    CUDA_BANNED_OPS,
    CUDA_FP32_APPEND_DTYPE_OPS,
    CUDA_FP32_OPS,
    CUDA_FP32_SET_OPT_DTYPE_OPS,
    CUDA_LOWER_PRECISION_FP_OPS,
    CUDA_PROMOTE_OPS,
    CudaAutocastEmulation,
    autocast_context,
    default_autocast_policy,
)

BF16, FP32 = torch.bfloat16, torch.float32


def emulation() -> CudaAutocastEmulation:
    ctx = autocast_context("cuda", "cpu", BF16)
    assert isinstance(ctx, CudaAutocastEmulation)
    return ctx


def randn(*shape: int, dtype: torch.dtype = FP32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_lists_are_exactly_the_installed_torchs_autocast_cuda_kernels() -> None:
    # The lists are copied from torch 2.11's sources; this keeps them honest against the binary.
    listed = {
        f"aten::{name}"
        for names in (
            CUDA_LOWER_PRECISION_FP_OPS,
            CUDA_FP32_OPS,
            CUDA_FP32_SET_OPT_DTYPE_OPS,
            CUDA_FP32_APPEND_DTYPE_OPS,
            CUDA_PROMOTE_OPS,
            CUDA_BANNED_OPS,
        )
        for name in names
    }
    registered = {
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    assert len(registered) > 100, "found almost no AutocastCUDA kernels: the probe is broken"
    assert listed == registered, (
        f"only in our lists: {sorted(listed - registered)}; "
        f"only in torch {torch.__version__}: {sorted(registered - listed)}"
    )
    assert "aten::rms_norm" not in registered and "aten::gelu" not in registered
    assert "aten::cat" not in registered and "aten::stack" not in registered


def test_linear_and_matmul_run_in_bf16_from_fp32_inputs() -> None:
    x, w, b = randn(4, 8), randn(6, 8, seed=1), randn(6, seed=2)
    with emulation():
        linear = F.linear(x, w, b)
        matmul = x @ w.T
        aten_linear = torch.ops.aten.linear.default(x, w, b)
        sdpa = F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
    assert (linear.dtype, matmul.dtype, aten_linear.dtype, sdpa.dtype) == (BF16,) * 4
    # CUDA casts the inputs, then runs the op: the same as casting by hand.
    assert torch.equal(linear, F.linear(x.to(BF16), w.to(BF16), b.to(BF16)))
    assert torch.equal(matmul, x.to(BF16) @ w.T.to(BF16))


def test_fp32_list_runs_in_fp32_from_bf16_inputs() -> None:
    x = randn(2, 4, 8, dtype=BF16)
    weight, bias = torch.ones(8, dtype=BF16), torch.zeros(8, dtype=BF16)
    with emulation():
        outputs = {
            "layer_norm": F.layer_norm(x, (8,), weight, bias),
            "group_norm": F.group_norm(x, 2),
            "softmax": F.softmax(x, dim=-1),
            "Tensor.softmax": x.softmax(-1),
            "log_softmax": F.log_softmax(x, dim=-1),
            "sum": x.sum(),
            "exp": torch.exp(x),
            "pow": x**2,
            "rsqrt": x.abs().rsqrt(),
            "reciprocal via 1 / x": 1 / x,
            "norm": x.norm(),
        }
    assert {name: y.dtype for name, y in outputs.items()} == dict.fromkeys(outputs, FP32)
    by_hand = F.layer_norm(x.float(), (8,), weight.float(), bias.float())
    assert torch.equal(outputs["layer_norm"], by_hand)
    assert torch.equal(outputs["softmax"], F.softmax(x, dim=-1, dtype=FP32))


def test_rms_norm_and_gelu_are_on_no_cuda_list_and_keep_bf16() -> None:
    x = randn(4, 8, dtype=BF16)
    with emulation():
        assert F.rms_norm(x, (8,)).dtype == BF16
        assert F.gelu(x, approximate="tanh").dtype == BF16
        assert F.silu(x).dtype == BF16


def test_cat_of_bf16_and_fp32_gives_fp32() -> None:
    # cat is on no CUDA autocast list in torch 2.11: it promotes natively, with or without autocast.
    with emulation():
        out = torch.cat([randn(2, 3, dtype=BF16), randn(2, 3)])
    assert out.dtype == FP32


def test_promote_list_takes_the_widest_floating_input() -> None:
    a, b = randn(4, dtype=BF16), randn(4, dtype=BF16, seed=1)
    with emulation():
        mixed = torch.addcmul(a, b, randn(4, seed=2))
        all_bf16 = torch.addcmul(a, b, b)
    assert (mixed.dtype, all_bf16.dtype) == (FP32, BF16)


def test_cpu_policy_keeps_layer_norm_in_bf16_where_cuda_policy_uses_fp32() -> None:
    x = randn(4, 8, dtype=BF16)
    with autocast_context("cpu", "cpu", BF16):
        cpu_policy = F.layer_norm(x, (8,))
    with autocast_context("cuda", "cpu", BF16):
        cuda_policy = F.layer_norm(x, (8,))
    assert (cpu_policy.dtype, cuda_policy.dtype) == (BF16, FP32)


def test_gradients_flow_through_the_casts_to_fp32_parameters() -> None:
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    with emulation():
        out = model(randn(3, 8))
        hidden = model[1](model[0](randn(3, 8)))
    assert (out.dtype, hidden.dtype) == (BF16, FP32)
    out.float().square().sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == FP32, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_nested_autocast_disable_turns_casting_off(device_type: str) -> None:
    # diffusers disables autocast around rotary embeddings with either device type.
    x, w = randn(4, 8), randn(6, 8, seed=1)
    with emulation():
        with torch.autocast(device_type, enabled=False):
            inside_linear = F.linear(x, w)
            inside_norm = F.layer_norm(x.to(BF16), (8,))
        after = F.linear(x, w)
    assert (inside_linear.dtype, inside_norm.dtype, after.dtype) == (FP32, BF16, BF16)


def test_state_is_restored_after_exit_even_on_error() -> None:
    before = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
    x, w = randn(4, 8), randn(6, 8, seed=1)
    with pytest.raises(ZeroDivisionError), emulation():
        assert torch.is_autocast_enabled("cuda"), "code inside should see autocast on, as on a GPU"
        raise ZeroDivisionError
    assert (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")) == before
    assert F.linear(x, w).dtype == FP32
    assert F.layer_norm(x.to(BF16), (8,)).dtype == BF16


def test_explicit_dtype_float64_and_integers_are_left_alone() -> None:
    x = randn(4, 8, dtype=BF16)
    with emulation():
        assert F.softmax(x, dim=-1, dtype=BF16).dtype == BF16
        assert x.sum(dtype=BF16).dtype == BF16
        fp64 = torch.float64
        assert F.linear(randn(2, 3, dtype=fp64), randn(4, 3, dtype=fp64)).dtype == fp64
        assert torch.arange(5).sum().dtype == torch.int64
        out = torch.empty(4, 8, dtype=BF16)
        assert torch.exp(x, out=out).dtype == BF16  # out= overloads are not autocast on CUDA


def test_binary_cross_entropy_is_refused_as_cuda_autocast_refuses_it() -> None:
    p = torch.sigmoid(randn(4))
    with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"), emulation():
        F.binary_cross_entropy(p, torch.ones(4))


def test_unknown_policy_names_it_and_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown autocast policy 'gpu'\. Known: 'cuda', 'cpu'\."):
        autocast_context("gpu", "cpu", BF16)


def test_bad_device_dtype_and_policy_device_pairs_raise() -> None:
    with pytest.raises(ValueError, match=r"policy 'cpu' .* device 'cuda:0'"):
        autocast_context("cpu", "cuda:0", BF16)
    with pytest.raises(ValueError, match=r"Unsupported autocast dtype torch\.float32"):
        autocast_context("cuda", "cpu", FP32)
    with pytest.raises(ValueError, match=r"Unsupported device type 'meta'"):
        autocast_context("cuda", "meta", BF16)


def test_policies_and_defaults() -> None:
    assert AUTOCAST_POLICIES == ("cuda", "cpu")
    assert default_autocast_policy("cpu") == "cuda"
    assert default_autocast_policy(torch.device("cuda", 0)) == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" on a CPU-only machine
        ctx = autocast_context("cuda", "cuda", BF16)
    assert isinstance(ctx, torch.autocast) and (ctx.device, ctx.fast_dtype) == ("cuda", BF16)
    ctx = autocast_context("cpu", torch.device("cpu"), BF16)
    assert isinstance(ctx, torch.autocast) and (ctx.device, ctx.fast_dtype) == ("cpu", BF16)


FLUX_TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)


def flux_inputs(dtype: torch.dtype) -> dict[str, object]:
    # Same as FluxPipeline._prepare_latent_image_ids(1, 8, 8, "cpu", dtype) in diffusers 0.42.1,
    # written out because importing FluxPipeline needs transformers.
    img_ids = torch.zeros(8, 8, 3)
    img_ids[..., 1] += torch.arange(8)[:, None]
    img_ids[..., 2] += torch.arange(8)[None, :]
    return dict(
        hidden_states=randn(1, 64, 16, seed=1).to(dtype),
        encoder_hidden_states=randn(1, 8, 32, seed=2).to(dtype),
        pooled_projections=randn(1, 32, seed=3).to(dtype),
        timestep=torch.full((1,), 0.75),
        img_ids=img_ids.reshape(64, 3).to(dtype),
        txt_ids=torch.zeros(8, 3, dtype=dtype),
        guidance=torch.full((1,), 3.5),
        return_dict=False,
    )


def test_flux_fp32_under_cuda_policy_differs_from_bf16_eager_where_cpu_autocast_does_not() -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**FLUX_TINY).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' "keep in float32" note on .to(bf16)
        model_bf16 = copy.deepcopy(model).to(BF16)
    with torch.no_grad(), warnings.catch_warnings():
        # rms_norm on bf16 activations with fp32 weights warns that it cannot use a fused kernel.
        warnings.simplefilter("ignore")
        (bf16_eager,) = model_bf16(**flux_inputs(BF16))
        with autocast_context("cpu", "cpu", BF16):
            (cpu_policy,) = model(**flux_inputs(FP32))
        with autocast_context("cuda", "cpu", BF16):
            (cuda_policy,) = model(**flux_inputs(FP32))

    assert bf16_eager.dtype == cpu_policy.dtype == cuda_policy.dtype == BF16
    assert bf16_eager.abs().mean() > 0.1, "degenerate output: the comparison would say nothing"
    # Measured here (torch 2.11.0, diffusers 0.42.1): CPU autocast reproduces bf16 eager bit for
    # bit, so a CPU run under it would hide the norm/softmax divergence the H200 shows.
    assert torch.equal(cpu_policy, bf16_eager)
    assert not torch.equal(cuda_policy, bf16_eager)
