"""Chunked log-probs/entropy from hidden states equal the full-logits path (one process).

The reference is `vocab_parallel_log_probs_and_entropy(hidden @ weight.T, ...)` with
autograd through the matmul: what the trainer computes today from GPTModel's logits.
Checked for several chunk sizes (1, one not dividing N, N, more than N), temperature != 1,
a padded vocabulary, with and without entropy, labels or not.

Tolerances:
* float64: 1e-12 absolute — the same formulas, only the matmul blocking differs per chunk.
* float32: 1e-5 absolute + 1e-5 relative (fp32 sums of a few hundred terms in another
  order; the vocab-parallel tests use 1e-5 absolute).
* bfloat16: both paths compute the logits and d loss / d logits in bf16 the same way,
  and the statistics in fp32, so the values get 1e-5 abs (on CPU the per-chunk matmul
  reproduces the full one). The gradients are bf16 matmuls rounded differently: the full
  path's weight gradient is one GEMM over N tokens, the chunked one a bf16 GEMM per chunk
  (CPU has no bf16 x bf16 -> fp32 matmul) summed in fp32, then rounded once more. Both
  are compared with the exact (fp64) product of the same bf16 logits gradient G, within
  2^-7 * (|G|^T |H|) elementwise (|G| |W| for the hidden gradient): four bf16 roundings
  (2^-9 each) of the sum of magnitudes. CPU bf16 GEMMs round inside the sum too; the
  largest error measured was 2.9 * 2^-9 (chunked) and 1.7 * 2^-9 (full).
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.models.chunked_logprobs import chunked_log_probs_and_entropy
from rl_megatron.models.vocab_parallel import vocab_parallel_log_probs_and_entropy

N, H, PADDED, VOCAB = 37, 24, 64, 58  # ids 58..63 are padding


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    # Scale so logits are O(3): the softmax is peaked and temperature matters.
    weight = torch.randn(PADDED, H, generator=gen) * (3 / H**0.5)
    weight[VOCAB:] += 0.5  # padding rows would dominate if they were not excluded
    labels = torch.randint(0, VOCAB, (N,), generator=gen)
    labels[0], labels[1] = 0, VOCAB - 1
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    # Upstream gradients N(0, 1) on log-probs and entropy (far from the 1s of .sum()).
    g_lp, g_ent = torch.randn(2, N, generator=gen, dtype=wide).unbind()
    return hidden.to(dtype), weight.to(dtype), labels, g_lp, g_ent


def _full(hidden, weight, labels, temperature, vocab_size, with_entropy, g_lp, g_ent):
    """Reference: logits, then vocab_parallel; returns values, grads and d loss / d logits."""
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = h @ w.t()
    logits.retain_grad()
    lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, None, temperature, vocab_size)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad, logits.grad


def _chunked(hidden, weight, labels, temperature, vocab_size, with_entropy, g_lp, g_ent, chunk):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = chunked_log_probs_and_entropy(
        h,
        w,
        labels,
        None,
        temperature=temperature,
        vocab_size=vocab_size,
        chunk_tokens=chunk,
        with_entropy=with_entropy,
    )
    assert (ent is not None) == with_entropy
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


CASES = [  # (temperature, vocab_size)
    (1.0, None),
    (0.7, VOCAB),
    (1.3, VOCAB),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature,vocab_size", CASES)
def test_matches_full_logits(dtype, with_entropy, temperature, vocab_size):
    hidden, weight, labels, g_lp, g_ent = _inputs(dtype)
    lp, ent, gh, gw, g_logits = _full(
        hidden, weight, labels, temperature, vocab_size, with_entropy, g_lp, g_ent
    )
    for chunk in (1, 5, 16, N, 1024):
        c_lp, c_ent, c_gh, c_gw = _chunked(
            hidden, weight, labels, temperature, vocab_size, with_entropy, g_lp, g_ent, chunk
        )
        assert c_lp.dtype == lp.dtype and c_gh.dtype == dtype and c_gw.dtype == dtype
        if dtype == torch.float64:
            tol = dict(atol=1e-12, rtol=0)
        else:
            tol = dict(atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 0)
        torch.testing.assert_close(c_lp, lp, **tol, msg=f"log_prob, chunk {chunk}")
        if with_entropy:
            torch.testing.assert_close(c_ent, ent, **tol, msg=f"entropy, chunk {chunk}")
        if dtype != torch.bfloat16:
            torch.testing.assert_close(c_gh, gh, **tol, msg=f"grad hidden, chunk {chunk}")
            torch.testing.assert_close(c_gw, gw, **tol, msg=f"grad weight, chunk {chunk}")
            continue
        # Against the exact products of the bf16 logits gradient (both paths round it
        # the same way): the full path must meet the bound too, or the bound is wrong.
        g = g_logits.double()
        for name, got, ref, exact, bound in (
            ("hidden", c_gh, gh, g @ weight.double(), g.abs() @ weight.double().abs()),
            ("weight", c_gw, gw, g.t() @ hidden.double(), g.abs().t() @ hidden.double().abs()),
        ):
            for path, value in (("chunked", got), ("full", ref)):
                err = (value.double() - exact).abs()
                assert (err <= 2.0**-7 * bound).all(), f"{path} grad {name}, chunk {chunk}"


def test_padding_gets_no_gradient_and_entropy_only():
    hidden, weight, labels, g_lp, g_ent = _inputs(torch.float64)
    w = weight.clone().requires_grad_(True)
    lp, ent = chunked_log_probs_and_entropy(hidden, w, None, None, vocab_size=VOCAB, chunk_tokens=7)
    assert lp is None
    _, ref_ent, *_ = _full(hidden, weight, labels, 1.0, VOCAB, True, g_lp * 0, g_ent)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    (ent * g_ent).sum().backward()
    assert (w.grad[VOCAB:] == 0).all()  # padded rows: probability 0, no gradient
    assert w.grad[:VOCAB].abs().sum() > 0


def test_gradcheck_float64():
    """Finite differences, both inputs, both outputs, temperature and padding."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (7,), generator=gen)

    def f(h, w):
        return chunked_log_probs_and_entropy(
            h, w, labels, None, temperature=0.8, vocab_size=10, chunk_tokens=3
        )

    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_leading_dims_and_no_weight_grad():
    """[b, r, h] in, [b, r] out; a frozen weight gets no gradient and costs none."""
    hidden, weight, labels, *_ = _inputs(torch.float64)
    h3 = hidden[:36].reshape(4, 9, H).clone().requires_grad_(True)
    lp, ent = chunked_log_probs_and_entropy(
        h3, weight, labels[:36].view(4, 9), None, chunk_tokens=8
    )
    assert lp.shape == ent.shape == (4, 9)
    ref_lp, ref_ent, *_ = _full(hidden[:36], weight, labels[:36], 1.0, None, True, 1.0, 1.0)
    torch.testing.assert_close(lp.reshape(-1), ref_lp, atol=1e-12, rtol=0)
    (lp.sum() + ent.sum()).backward()
    assert h3.grad is not None and h3.grad.shape == h3.shape


def test_bad_input():
    hidden, weight, labels, *_ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="labels"):
        chunked_log_probs_and_entropy(hidden, weight, labels[:3], None)
    with pytest.raises(ValueError, match="same h"):
        chunked_log_probs_and_entropy(hidden[:, :5], weight, labels, None)
    with pytest.raises(ValueError, match="bfloat16"):
        chunked_log_probs_and_entropy(hidden, weight.bfloat16(), labels, None)
    with pytest.raises(ValueError, match="temperature"):
        chunked_log_probs_and_entropy(hidden, weight, labels, None, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size 65"):
        chunked_log_probs_and_entropy(hidden, weight, labels, None, vocab_size=65)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_log_probs_and_entropy(hidden, weight, labels, None, chunk_tokens=0)
    with pytest.raises(ValueError, match="nothing to compute"):
        chunked_log_probs_and_entropy(hidden, weight, None, None, with_entropy=False)
