"""Without Triton installed, the package imports and every op runs its torch fallback (README: Dispatch).

The test reruns this file in a fresh interpreter in which importing triton fails as it does where Triton is
not installed, and checks each op's forward and backward there against the float64 references.
"""

import importlib.abc
import os
import pathlib
import subprocess
import sys

OPS = ["rms_norm", "swiglu", "swiglu_gate_up", "geglu", "rope", "partial_rope", "linear_cross_entropy"]


class _NoTriton(importlib.abc.MetaPathFinder):
    """Answers every import of triton, or of one of its submodules, with the error of a missing package."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_ops_fall_back_to_torch_without_triton():
    import slide_kernels

    here = pathlib.Path(__file__)
    paths = [str(pathlib.Path(slide_kernels.__file__).parents[1]), str(here.parent), os.environ.get("PYTHONPATH")]
    # TRITON_INTERPRET=1 would send CPU tensors to the kernels: the missing Triton must take precedence.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    run = subprocess.run([sys.executable, str(here)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == OPS  # each op checked, in order


def _check(name, op, ref, *inputs, tol=1e-4):
    """`op(*inputs)` and its input gradients (one random upstream gradient) against `ref` in float64."""
    import torch
    from kernels_reference import max_err

    twins = [t.detach().double().requires_grad_() for t in inputs]
    outs, refs = op(*inputs), ref(*twins)
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    ups = [torch.randn_like(o) for o in outs]
    sum((o * u).sum() for o, u in zip(outs, ups)).backward()
    sum((r * u.double()).sum() for r, u in zip(refs, ups)).backward()
    for ours, want in zip([*outs, *(t.grad for t in inputs)], [*refs, *(t.grad for t in twins)]):
        assert max_err(ours, want) < tol * max(1.0, want.abs().max().item()), name
    print(name)


def _check_ops() -> None:
    import torch
    from kernels_reference import geglu_ref, linear_ce_ref, partial_rope_ref, rms_norm_ref, rope_ref, swiglu_ref

    import slide_kernels as sk
    from slide_kernels import _dispatch

    assert not _dispatch.triton_available() and "triton" not in sys.modules
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 37, requires_grad=True), (torch.rand(37) + 0.5).requires_grad_()
    _check("rms_norm", lambda x, w: sk.rms_norm(x, w, 1e-5), lambda x, w: rms_norm_ref(x, w, 1e-5), x, w)
    a, b = torch.randn(3, 5, 37, requires_grad=True), torch.randn(3, 5, 37, requires_grad=True)
    _check("swiglu", sk.swiglu, swiglu_ref, a, b)
    gate_up = torch.randn(3, 5, 2 * 37, requires_grad=True)
    _check("swiglu_gate_up", sk.swiglu_gate_up, lambda x: swiglu_ref(x[..., :37], x[..., 37:]), gate_up)
    a, b = (torch.randn(3, 5, 37, requires_grad=True) for _ in range(2))
    _check("geglu", sk.geglu, geglu_ref, a, b)
    q, k = torch.randn(2, 4, 7, 16, requires_grad=True), torch.randn(2, 2, 7, 16, requires_grad=True)
    cos, sin = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    _check("rope", lambda q, k: sk.rope(q, k, cos, sin), lambda q, k: rope_ref(q, k, cos, sin), q, k)
    q, k = torch.randn(2, 4, 7, 16, requires_grad=True), torch.randn(2, 2, 7, 16, requires_grad=True)
    c6, s6 = cos[..., :6], sin[..., :6]
    _check("partial_rope", lambda q, k: sk.partial_rope(q, k, c6, s6), lambda q, k: partial_rope_ref(q, k, c6, s6),
           q, k)
    hidden, weight = torch.randn(3, 11, 29, requires_grad=True), (torch.randn(123, 29) * 0.3).requires_grad_()
    bias, labels = (torch.randn(123) * 0.1).requires_grad_(), torch.randint(0, 123, (3, 11))
    labels[:, :2] = -100
    opts = dict(label_smoothing=0.1, softcap=4.0, z_loss=1e-3)

    def ours(h, w, b):
        return sk.linear_cross_entropy(h, w, labels, bias=b, **opts)

    def ref(h, w, b):
        return linear_ce_ref(h, w, labels, bias=b, **opts)

    _check("linear_cross_entropy", ours, ref, hidden, weight, bias)


if __name__ == "__main__":
    sys.meta_path.insert(0, _NoTriton())
    _check_ops()
