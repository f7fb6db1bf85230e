"""SyncBatchNorm: batch normalization with statistics over every rank's batch.

In training, each rank computes its batch's per-channel count, mean and sum
of squared deviations; one gather (an allreduce of a row per rank) combines
them (the parallel-variance formula, stable where E[x^2] - E[x]^2 is not) into
the statistics of the union of all ranks' batches. The backward pass needs two per-channel sums over
that union, obtained with one allreduce. Weight and bias gradients stay local,
as in ``torch.nn.SyncBatchNorm``: :class:`DistributedOptimizer` averages them
like any other gradient. In evaluation, or on one rank, it is plain batch norm.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from spark_dl.common.handles import synchronize
from spark_dl.common.ops import Sum, set_size
from spark_dl.common.process_sets import global_process_set
from spark_dl.torch._async_ops import allreduce_async, allreduce_async_

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the union of every rank's batch (inputs of 2 or more dims).

    Takes the arguments of ``torch.nn.BatchNorm1d/2d/3d`` plus ``process_set``
    (the ranks whose batches are normalized together). Every member must call
    forward and backward in the same order.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training or set_size(self.process_set) == 1:
            use_batch_stats = self.training or self.running_mean is None
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch_stats, factor, self.eps)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """Returns ``module`` with each ``BatchNorm*d`` replaced by a SyncBatchNorm (same state)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set)
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out


def _channel_view(t, ndim):
    """A per-channel vector shaped to broadcast against (N, C, *spatial)."""
    return t.view([1, -1] + [1] * (ndim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        # Statistics in float32 at least, whatever the input dtype.
        xs = x.detach().to(torch.promote_types(x.dtype, torch.float32))
        count = x.numel() // channels if channels else 0
        if count:
            mean = xs.mean(dims)
            m2 = ((xs - _channel_view(mean, x.dim())) ** 2).sum(dims)
        else:
            mean = m2 = xs.new_zeros(channels)
        local = torch.cat([xs.new_tensor([float(count)]), mean, m2]).to(torch.float64)
        # Gathered by one Sum allreduce of a row per member, each filling its own (exact:
        # the other rows add zeros), into memory PyTorch allocates: an allgather's result
        # would be a core allocation on the GPU, whose cudaFree synchronizes the device,
        # once per layer and step.
        every = local.new_zeros((set_size(process_set), local.numel()))
        every[process_set.rank()] = local
        every = synchronize(allreduce_async_(every, op=Sum, process_set=process_set))
        counts = every[:, :1]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError("Expected more than 1 value per channel when training, got "
                             f"{int(total)} over all ranks (input size {list(x.shape)})")
        means = every[:, 1:1 + channels]
        mean64 = (counts * means).sum(0) / total
        var64 = (every[:, 1 + channels:] + counts * (means - mean64) ** 2).sum(0) / total
        mean = mean64.to(xs.dtype)
        invstd = torch.rsqrt(var64 + eps).to(xs.dtype)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean64.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var64 * total / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        y = (xs - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        if weight is not None:
            y = y * _channel_view(weight.detach().to(xs.dtype), x.dim())
        if bias is not None:
            y = y + _channel_view(bias.detach().to(xs.dtype), x.dim())
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.args = (total, process_set, None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        total, process_set, bias_dtype = ctx.args
        nd = x.dim()
        channels = x.shape[1]
        dims = [0] + list(range(2, nd))
        xmu = x.to(mean.dtype) - _channel_view(mean, nd)
        dyc = dy.to(mean.dtype)
        sum_dy = dyc.sum(dims)
        sum_dy_xmu = (dyc * xmu).sum(dims)
        # Local sums give the local weight/bias gradients; their totals over every rank
        # give the input gradient (the batch statistics depend on every rank's input).
        totals = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                             process_set=process_set))
        g_dy, g_dy_xmu = totals[:channels], totals[channels:]
        scale = invstd if weight is None else invstd * weight.detach().to(mean.dtype)
        dx = (dyc - _channel_view(g_dy / total, nd)
              - xmu * _channel_view(invstd * invstd * g_dy_xmu / total, nd))
        dx = dx * _channel_view(scale, nd)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(bias_dtype) if bias_dtype is not None else None
        return dx.to(x.dtype), grad_weight, grad_bias, None, None, None, None, None
