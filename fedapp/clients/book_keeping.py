"""``grad-sample-mode = "bk"``: DP-SGD's clipped gradient by book-keeping with mixed ghost norms (Bu et al., ICML 2023).

The step is Opacus' flat DP-SGD step (Abadi et al. 2016, Alg. 1): every per-sample gradient g_i clipped by
min(1, C/(‖g_i‖ + 1e-6)), N(0, C²z²) added to their sum as Opacus' ``DPOptimizer`` draws it (its generator, its order
of parameters; from 2^22 parameters on a multi-threaded CPU in parallel chunks: :mod:`fedapp.clients.noise`), the
result divided by the expected batch size. Only how Σ_i c_i g_i is computed differs from ``hooks``:

1. one backward pass for the gradients of the loss with respect to each trainable layer's *output* only
   (``torch.autograd.grad``): autograd then skips every weight gradient, which a plain backward computes and
   ``hooks`` throws away;
2. per layer, ‖g_i‖² from the layer's input a and output gradient b (book-keeping: both are kept from step 1),
   whichever way is cheaper for its shape (mixed ghost clipping): a Linear layer over one vector per sample by
   ‖a_i‖²‖b_i‖², a layer over T positions by the ghost norm Σ_{t,s} (a_it·a_is)(b_it·b_is) when
   T²(D + p) < D·p, else from the materialised per-sample gradient (a one-group Conv2d on a CPU by oneDNN's weight
   gradient with one group per sample from 16 input channels and 144 output positions on, otherwise by its own
   im2col and a batched matmul; every other layer type Opacus knows by Opacus' per-sample rule);
3. Σ_i c_i g_i per layer, without a second backward: (c ⊙ b)ᵀ a for a ghost layer, Σ_i c_i G_i for a materialised one.

A per-sample gradient whose norm is not finite counts as 0, as in :mod:`fedapp.clients.finite_clipping`. The
clipped sum equals ``hooks``' to float rounding (``tests/unit/fedapp/clients/test_book_keeping.py``, and
``tests/unit/fedapp/models/test_dp_models.py`` against one-sample autograd for every catalog model). Opacus offers
ghost clipping only with a second backward pass (``grad_sample_mode = "ghost"``) and no book-keeping, and the
authors' fastDP installs from a git clone for torch ≤ 1.11, so this module writes steps 1-3 and reuses Opacus'
per-sample rules and its optimizer. Timings: docs/benchmarks.md, "DP-SGD step". A model it cannot run refuses with a
``ValueError`` naming the layer (``auto`` then keeps the other modes): a trainable layer called twice in one forward
pass, an output changed in place afterwards (``ReLU(inplace=True)`` on it), a layer type without a per-sample rule
(types match exactly, as Opacus' rules: a subclass with its own forward has none), and, checked once on the first
batch against autograd's gradient, a parameter the rules would not give its gradient (one also used outside its
layer's forward, e.g. tied weights).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fedapp.clients.finite_clipping import finite_clip_factors, zero_rows_


def _set_sum(p: torch.Tensor, value: torch.Tensor) -> None:
    """Σ_i c_i g_i for ``p``, where Opacus' optimizer reads it (``p.summed_grad``)."""
    setattr(p, "summed_grad", value)  # noqa: B010 — an attribute torch.Tensor does not declare


def _zero_sums(layers: Iterable[_Layer]) -> None:
    """A clipped sum of 0 for every trainable parameter of ``layers`` (no gradient reaches them)."""
    for layer in layers:
        for p in layer.params:
            _set_sum(p, torch.zeros_like(p))


class _Layer:
    """One module with trainable parameters of its own: what its last forward pass saw."""

    __slots__ = ("name", "module", "params", "inputs", "output", "version")

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.name, self.module, self.params = name, module, params
        self.inputs: list[torch.Tensor] | None = None
        self.output: torch.Tensor | None = None
        self.version = 0


def _ghost_cheaper(positions: int, d_in: int, d_out: int) -> bool:
    """Whether the ghost norm (T²(D + p) per sample) costs less than the per-sample gradient (T·D·p)."""
    return positions * (d_in + d_out) < d_in * d_out


class BookKeeping:
    """Forward hooks on ``model``'s trainable layers and :meth:`clipped_sum`, which sets each trainable parameter's
    ``summed_grad`` to Σ_i c_i g_i for :class:`BookKeepingDPOptimizer`. ``close()`` removes the hooks."""

    def __init__(self, model: nn.Module) -> None:
        from opacus.grad_sample import GradSampleModule

        self.samplers = GradSampleModule.GRAD_SAMPLERS
        self.layers: list[_Layer] = []
        for name, module in model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not params:
                continue
            if not self._supported(module):
                raise ValueError(f"grad-sample-mode 'bk' has no per-sample rule for layer {name!r} "
                                 f"({type(module).__name__}); use 'hooks'")
            self.layers.append(_Layer(name, module, params))
        self._handles = [layer.module.register_forward_hook(functools.partial(self._capture, layer))
                         for layer in self.layers]
        self.checked = False  # whether the layer rules were checked against autograd's gradient (first batch)

    def _supported(self, module: nn.Module) -> bool:
        return type(module) is nn.Linear or type(module) in self.samplers  # exact types, as Opacus' rules

    @staticmethod
    def _capture(layer: _Layer, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if layer.output is not None:
            raise ValueError(f"grad-sample-mode 'bk': layer {layer.name!r} ran twice in one forward pass "
                             "(shared weights); use 'hooks'")
        if not isinstance(output, torch.Tensor):
            raise ValueError(f"grad-sample-mode 'bk': layer {layer.name!r} returns {type(output).__name__}, "
                             "not one tensor; use 'hooks'")
        layer.inputs = [t.detach() for t in inputs if isinstance(t, torch.Tensor)]
        layer.output, layer.version = output, output._version

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._reset()

    def _reset(self) -> None:
        for layer in self.layers:
            layer.inputs = layer.output = None

    def zero_sum(self) -> None:
        """An empty Poisson batch: every clipped sum is 0 (the step is the noise alone)."""
        self._reset()
        _zero_sums(self.layers)

    def clipped_sum(self, loss: torch.Tensor, clip: float) -> None:
        """Σ_i min(1, C/(‖g_i‖ + 1e-6)) g_i into each trainable parameter's ``summed_grad``, ``loss`` the batch mean."""
        ran = [layer for layer in self.layers if layer.output is not None]
        for layer in ran:
            assert layer.output is not None
            if layer.output._version != layer.version:
                raise ValueError(f"grad-sample-mode 'bk': the output of layer {layer.name!r} was changed in place "
                                 "after it ran (e.g. ReLU(inplace=True)); use 'hooks'")
        try:
            outs = [layer.output for layer in ran if layer.output is not None]
            grads = torch.autograd.grad(loss, outs, allow_unused=True, retain_graph=not self.checked) if outs else ()
            batch = next((len(layer.inputs[0]) for layer in ran if layer.inputs), 0)
            parts = [self._layer_norms(layer, grad, batch) for layer, grad in zip(ran, grads)]
            if not parts:
                self.zero_sum()
                return
            if not self.checked:
                self._check_against_autograd(loss, batch, parts)
            squared = parts[0][0] if len(parts) == 1 else torch.stack([sq for sq, _ in parts], 1).sum(1)
            factor, rows = finite_clip_factors(squared.clamp(min=0).sqrt(), clip)  # 0 where not finite
            for _, summer in parts:
                summer(factor, rows)
            _zero_sums(layer for layer in self.layers if layer.output is None)  # not in this forward pass
        finally:
            self._reset()

    def _check_against_autograd(self, loss: torch.Tensor, batch: int, parts: list) -> None:
        """Once, on the first batch: the layer rules' unclipped sum Σ_i g_i must be the batch's gradient as autograd
        computes it (× B for the mean), parameter by parameter. A parameter used outside its layer's forward (tied
        weights, ``F.linear(x, self.fc.weight)``) or a layer whose forward the rules do not describe would train on
        a different gradient; that is refused, naming the parameters. One more backward pass, once a training."""
        params = [p for layer in self.layers for p in layer.params]
        names = {id(p): f"{layer.name}.{n}" if layer.name else n for layer in self.layers
                 for n, p in layer.module.named_parameters(recurse=False) if p.requires_grad}
        expected = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
        ones = torch.ones(batch, device=params[0].device)
        no_rows = torch.zeros(0, dtype=torch.long, device=params[0].device)
        for _, summer in parts:
            summer(ones, no_rows)
        _zero_sums(layer for layer in self.layers if layer.output is None)
        wrong = []
        for p, g in zip(params, expected):
            want = torch.zeros_like(p) if g is None else g * batch
            got = getattr(p, "summed_grad")  # noqa: B009 — an attribute torch.Tensor does not declare (mypy)
            if not (torch.isfinite(want).all() and torch.isfinite(got).all()):
                continue  # a non-finite record: the clip step zeroes it, nothing to compare on this batch
            if not torch.allclose(got.reshape(want.shape), want, rtol=1e-3, atol=1e-6 * max(1.0, float(want.abs().max()))):
                wrong.append(names.get(id(p), "?"))
        if wrong:
            raise ValueError(f"grad-sample-mode 'bk': its layer rules do not give the model's gradient for {wrong} "
                             "(a parameter used outside its layer's forward, e.g. tied weights, or a layer subclass "
                             "with its own forward); use 'hooks'")
        self.checked = True

    def _layer_norms(self, layer: _Layer, grad: torch.Tensor | None, batch: int):
        """(‖g_i‖² of this layer's trainable parameters [B], a function (c, non-finite rows) that writes
        Σ_i c_i g_i into their ``summed_grad``)."""
        module, inputs = layer.module, layer.inputs
        assert inputs is not None
        if grad is None:  # the loss does not depend on this layer
            return torch.zeros(batch, device=layer.params[0].device), lambda factor, rows: _zero_sums([layer])
        # the per-sample losses' output gradients are ``grad * batch`` (Opacus' "mean"); the Linear and Conv2d rules
        # take ``grad`` and apply the factor to their [B] norms and clip factors, sparing a pass over ``grad``
        if type(module) is nn.Linear:
            assert isinstance(module, nn.Linear)
            return _scaled(_linear(module, layer.params, inputs[0], grad), batch)
        if type(module) is nn.Conv2d and _plain_conv2d(module):
            return _scaled(_conv2d(module, layer.params, inputs[0], grad), batch)
        per_sample = self.samplers[type(module)](module, inputs, grad * batch)
        per_sample = {p: g for p, g in per_sample.items() if any(p is q for q in layer.params)}
        squared = torch.stack([_squared_norms(g) for g in per_sample.values()], 1).sum(1)

        def materialised(factor: torch.Tensor, rows: torch.Tensor) -> None:
            for p, g in per_sample.items():
                g = _zero_rows(g, rows)
                _set_sum(p, torch.einsum("i,i...->...", factor.to(g.dtype), g))

        return squared, materialised


def _squared_norms(g: torch.Tensor) -> torch.Tensor:
    """‖g_i‖² of each row of ``g`` [B, ...], without materialising g² (a norm kernel, then its square)."""
    return torch.linalg.vector_norm(g.reshape(len(g), -1), dim=1).square()


def _scaled(rule: tuple[torch.Tensor, Any], scale: float) -> tuple[torch.Tensor, Any]:
    """A layer rule run on output gradients ÷ ``scale``, as the rule on the gradients themselves: norms² × scale²,
    clipped sums by factors × scale (both on [B] vectors, not on the layer's tensors)."""
    squared, summed = rule
    return squared * (scale * scale), lambda factor, rows: summed(factor * scale, rows)


def _zero_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with the non-finite samples' rows set to 0 (:func:`~fedapp.clients.finite_clipping.zero_rows_` on a copy,
    ``t`` may be a layer's input; ``t`` itself when there are none), so 0·∞ never enters a sum."""
    return zero_rows_(t.clone(), rows) if rows.dtype == torch.bool or len(rows) else t


def _linear(module: nn.Linear, params: list[nn.Parameter], a: torch.Tensor, b: torch.Tensor):
    """``nn.Linear`` over [B, ..., d]: ‖g_i‖² by the ghost norm or the per-sample gradient, whichever is cheaper, and
    the clipped sum by one matmul (c ⊙ b)ᵀ a, what the plain backward computes with c = 1."""
    batch = len(a)
    a3, b3 = a.reshape(batch, -1, a.shape[-1]), b.reshape(batch, -1, b.shape[-1])
    positions = a3.shape[1]
    weight = any(p is module.weight for p in params)
    bias = module.bias is not None and any(p is module.bias for p in params)
    if positions == 1:  # ‖a_i‖²‖b_i‖² + ‖b_i‖² in a few operations: a small MLP's step is mostly their fixed cost
        a1, b1 = a3[:, 0], b3[:, 0]
        b_sq = torch.linalg.vecdot(b1, b1)
        if weight:
            a_sq = torch.linalg.vecdot(a1, a1)
            squared = torch.addcmul(b_sq, a_sq, b_sq) if bias else a_sq * b_sq
        else:
            squared = b_sq if bias else torch.zeros_like(b_sq)
        return squared, _linear_sum(module, weight, bias, a3, b3)
    squared = torch.zeros(batch, dtype=b.dtype, device=b.device)
    if weight:
        if _ghost_cheaper(positions, a3.shape[2], b3.shape[2]):
            squared = squared + (torch.bmm(a3, a3.transpose(1, 2)) * torch.bmm(b3, b3.transpose(1, 2))).sum((1, 2))
        else:
            squared = squared + _squared_norms(torch.einsum("btp,btd->bpd", b3, a3))
    if bias:
        squared = squared + b3.sum(1).pow(2).sum(1)
    return squared, _linear_sum(module, weight, bias, a3, b3)


def _linear_sum(module: nn.Linear, weight: bool, bias: bool, a3: torch.Tensor, b3: torch.Tensor):
    """The function (c, non-finite rows) ↦ Σ_i c_i g_i of a Linear layer with inputs ``a3`` [B, T, d] and output
    gradients ``b3`` [B, T, p]: weight (c ⊙ b)ᵀ a over the B·T rows, bias Σ (c ⊙ b)."""

    def summed(factor: torch.Tensor, rows: torch.Tensor) -> None:
        fa, fb = _zero_rows(a3, rows), _zero_rows(b3, rows) * factor.to(b3.dtype).view(-1, 1, 1)
        if weight:
            _set_sum(module.weight, fb.reshape(-1, fb.shape[2]).t().mm(fa.reshape(-1, fa.shape[2])))
        if bias:
            assert module.bias is not None
            _set_sum(module.bias, fb.sum((0, 1)))

    return summed


@functools.cache
def book_keeping_dp_optimizer() -> Any:
    """``BookKeepingDPOptimizer``: Opacus' ``DPOptimizer`` whose clipped sums :meth:`BookKeeping.clipped_sum` already
    wrote; scaling by the expected batch size and the wrapped step are Opacus' own, the noise Opacus' draws or, for a
    large model on a multi-threaded CPU, parallel draws (:func:`fedapp.clients.noise.add_noise_`)."""
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    from fedapp.clients.noise import add_noise_

    class BookKeepingDPOptimizer(DPOptimizer):
        def add_noise(self) -> None:
            if self.secure_mode:
                return super().add_noise()
            sums = [p.summed_grad for p in self.params]  # this step's, made by BookKeeping.clipped_sum: noised in place
            for s in sums:
                _check_processed_flag(s)
            self._noise_scratch = add_noise_(sums, self.noise_multiplier * self.max_grad_norm, self.generator,
                                             getattr(self, "_noise_scratch", None))
            for p, s in zip(self.params, sums, strict=True):
                p.grad = s.view_as(p)
                _mark_as_processed(s)
            return None

        def pre_step(self, closure: Any = None) -> bool:
            missing = [i for i, p in enumerate(self.params) if getattr(p, "summed_grad", None) is None]
            if missing:
                raise RuntimeError(f"grad-sample-mode 'bk': no clipped sum for parameters {missing} this step")
            self.add_noise()
            if self.loss_reduction == "mean":
                for p in self.params:
                    p.grad /= self.expected_batch_size
            if self.step_hook:
                self.step_hook(self)
            self._is_last_step_skipped = False
            return True

    return BookKeepingDPOptimizer



_CHUNK_ELEMENTS = 1 << 19  # im2col elements per chunk: 2 MiB of float32
_FEW_CHANNELS = 3
#: on a CPU, oneDNN's weight gradient with one group per sample is faster than im2col + bmm from this many input
#: channels and output positions on (0.73-0.80× for 16-32 channels at 14 × 14, 5 × 5 and 3 × 3 kernels; even at
#: 13 × 13 and 8 × 8; 2-4× slower at 4 × 4 or with 3 channels; 2-core AMD EPYC, batch 64, docs/benchmarks/dp_step.md)
_GROUPED_CHANNELS, _GROUPED_POSITIONS = 16, 144


def _plain_conv2d(module: nn.Module) -> bool:
    return (isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros"
            and not isinstance(module.padding, str))


def _conv2d(module: nn.Conv2d, params: list[nn.Parameter], a: torch.Tensor, b: torch.Tensor):
    """``nn.Conv2d`` (one group, zero padding) over T output positions with D = kh·kw·C inputs and p outputs each:
    ‖G_i‖² of the weight by the ghost norm over the im2col rows when T²(D + p) < D·p (the late, small-T layers of a
    ResNet), else from the per-sample gradients G_i = Σ_t b_it a_itᵀ (:func:`_conv2d_per_sample`); the bias's
    Σ_t b_it; the clipped sum Σ_i c_i G_i (one matmul (c ⊙ b)ᵀ a over the rows for a ghost layer)."""
    batch, channels = a.shape[0], a.shape[1]
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    ph, pw = (int(p) for p in module.padding)  # numbers: _plain_conv2d
    out_h, out_w = b.shape[2], b.shape[3]
    geometry = ((kh, kw), (sh, sw), (dh, dw), (ph, pw), (out_h, out_w))
    weight = any(p is module.weight for p in params)
    bias = module.bias is not None and any(p is module.bias for p in params)
    b3 = b.permute(0, 2, 3, 1).reshape(batch, out_h * out_w, -1)  # [B, T, O]: a view when b is channels-last
    squared = torch.zeros(batch, dtype=b.dtype, device=b.device)
    per_sample = cols = None
    if weight and _ghost_cheaper(out_h * out_w, kh * kw * channels, b3.shape[2]):
        cols = _im2col(a, *geometry)  # [B, T, D]
        squared = squared + (torch.bmm(cols, cols.transpose(1, 2)) * torch.bmm(b3, b3.transpose(1, 2))).sum((1, 2))
    elif weight and a.device.type == "cpu" and channels >= _GROUPED_CHANNELS and out_h * out_w >= _GROUPED_POSITIONS:
        per_sample = _conv2d_per_sample_grouped(module, a, b)  # [B, O, C, kh, kw]
        squared = squared + _squared_norms(per_sample)
    elif weight:
        per_sample = _conv2d_per_sample(a, b3, *geometry)  # [B, kh·kw·C, O]
        squared = squared + _squared_norms(per_sample)
    if bias:
        bias_sample = b3.sum(1)
        squared = squared + bias_sample.pow(2).sum(1)

    def summed(factor: torch.Tensor, rows: torch.Tensor) -> None:
        if per_sample is not None and per_sample.dim() == 5:
            _set_sum(module.weight, torch.einsum("i,i...->...", factor.to(per_sample.dtype),
                                                 _zero_rows(per_sample, rows)))
        elif per_sample is not None:
            g = torch.einsum("i,idp->dp", factor.to(per_sample.dtype), _zero_rows(per_sample, rows))
            _set_sum(module.weight, g.reshape(kh, kw, channels, -1).permute(3, 2, 0, 1).contiguous())
        if cols is not None:
            fb = _zero_rows(b3, rows) * factor.to(b3.dtype).view(-1, 1, 1)
            g = fb.reshape(-1, fb.shape[2]).t().mm(_zero_rows(cols, rows).reshape(-1, cols.shape[2]))  # [O, D]
            _set_sum(module.weight, g.reshape(-1, kh, kw, channels).permute(0, 3, 1, 2).contiguous())
        if bias:
            assert module.bias is not None
            _set_sum(module.bias, factor.to(b3.dtype) @ _zero_rows(bias_sample, rows))

    return squared, summed


def _window(a: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int],
            padding: tuple[int, int], out: tuple[int, int]) -> torch.Tensor:
    """The strided view [B, oh, ow, kh, kw, C] of the channels-last zero-padded input: every output position's
    receptive field, without a copy."""
    (kh, kw), (sh, sw), (dh, dw), (ph, pw), (out_h, out_w) = kernel, stride, dilation, padding, out
    padded = nn.functional.pad(a.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph)).contiguous()  # [B, H, W, C]
    s0, s1, s2, s3 = padded.stride()
    return padded.as_strided((len(a), out_h, out_w, kh, kw, a.shape[1]), (s0, s1 * sh, s2 * sw, s1 * dh, s2 * dw, s3))


def _im2col(a: torch.Tensor, *geometry: tuple[int, int]) -> torch.Tensor:
    """[B, T, kh·kw·C]: each output position's receptive field as a row, in (kh, kw, C) order."""
    window = _window(a, *geometry)
    return window.reshape(len(a), window.shape[1] * window.shape[2], -1)


def _conv2d_per_sample(a: torch.Tensor, b3: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                       dilation: tuple[int, int], padding: tuple[int, int], out: tuple[int, int]) -> torch.Tensor:
    """Per-sample weight gradients [B, kh·kw·C, O] (rows in (kh, kw, C) order) of a one-group convolution with input
    ``a`` [B, C, H, W] and output gradients ``b3`` [B, T, O], as im2col then one batched matmul. The im2col is
    a copy of the strided windows of the channels-last padded input, a few samples at a time so that each chunk is
    still in cache for its matmul; with few channels (a first layer) the windows in (kh, kw, C, oh, ow) order instead,
    one copy that moves whole rows rather than runs of C values (2.6× faster for one channel, 1.3× for 3, 1.4× slower
    for 16 channels: docs/benchmarks/dp_step.md)."""
    batch, channels = a.shape[0], a.shape[1]
    (kh, kw), (sh, sw), (dh, dw), (ph, pw), (out_h, out_w) = kernel, stride, dilation, padding, out
    positions, rows = out_h * out_w, kh * kw * channels
    per_sample = torch.empty((batch, rows, b3.shape[2]), dtype=b3.dtype, device=b3.device)
    if channels <= _FEW_CHANNELS:
        padded = nn.functional.pad(a.contiguous(), (pw, pw, ph, ph))  # [B, C, H, W]
        s0, s1, s2, s3 = padded.stride()
        window = padded.as_strided((batch, kh, kw, channels, out_h, out_w),
                                   (s0, s2 * dh, s3 * dw, s1, s2 * sh, s3 * sw))
        return torch.bmm(window.reshape(batch, rows, positions), b3, out=per_sample)
    window = _window(a, kernel, stride, dilation, padding, out)
    chunk = max(1, _CHUNK_ELEMENTS // (positions * rows))
    for lo in range(0, batch, chunk):
        cols = window[lo:lo + chunk].reshape(-1, positions, rows)
        torch.bmm(cols.transpose(1, 2), b3[lo:lo + chunk], out=per_sample[lo:lo + chunk])
    return per_sample


def _conv2d_per_sample_grouped(module: nn.Conv2d, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients [B, O, C, kh, kw] of a one-group convolution with input ``a`` [B, C, H, W] and
    output gradients ``b`` [B, O, oh, ow], as the weight gradient of one convolution with a group per sample (the
    batch folded into the channels): oneDNN's kernel reads the input where it lies, without an im2col copy."""
    batch, channels, out_channels = a.shape[0], a.shape[1], b.shape[1]
    x = a.contiguous().view(1, batch * channels, *a.shape[2:])
    grad = b.contiguous().view(1, batch * out_channels, *b.shape[2:])
    weight = module.weight.new_zeros(()).expand(batch * out_channels, channels, *module.kernel_size)  # its shape only
    per_sample = torch.ops.aten.convolution_backward(
        grad, x, weight, None, list(module.stride), [int(p) for p in module.padding], list(module.dilation), False,
        [0, 0], batch, [False, True, False])[1]
    return per_sample.view(batch, out_channels, channels, *module.kernel_size)
