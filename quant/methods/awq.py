"""AWQ (Lin et al. 2023): protect salient input channels by scaling them up before quantization.

For each group of Linears sharing one input (quant/folding.py: qkv, v->o, gate/up, up->down) grid-search
``alpha`` in [0, 1), ``s = mean|x|^alpha`` normalised by ``sqrt(max(s) * min(s))``, minimising the summed output
error ``||X Wᵀ - (X / s) Q(W s)ᵀ||²`` of the group's layers on calibration input rows; then fold ``s`` into the
producer (``transform``), so the full-precision model is unchanged and no runtime input scale is needed.
``alpha = 0`` is ``s = 1`` (plain RTN), so the chosen scales never do worse than RTN on the calibration rows.
Each weight is then quantized with a per-group clip search on the output error (AutoAWQ's ``auto_clip``).
With grouped-query attention the v->o scale lives on the kv channels and is repeated per query head (AutoAWQ
skips that pair when shapes differ).
"""
from __future__ import annotations

import torch
from rich.progress import track

from quant.folding import FoldGroup, fold_groups, fold_scale
from quant.methods.base import LayerStats, WeightMethod, register_method, require_stats
from quant.methods.mse import clip_search, output_error
from quant.qmath import fake_quantize
from quant.scheme import WeightSpec


def search_scale(group: FoldGroup, stats: LayerStats, spec: WeightSpec, n_grid: int = 20) -> tuple[torch.Tensor, float]:
    """The best scale (producer width) for ``group`` and its alpha."""
    x = stats.samples.float()
    weights = [lin.weight.detach().float() for lin in group.consumers.values()]
    ref = [x @ w.T for w in weights]
    x_mean = group.reduce_to_producer(stats.abs_mean.float())
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for step in range(n_grid):
        alpha = step / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wide = group.consumer_scale(s)
        err = sum(float(((x @ (fake_quantize(w * wide, spec) / wide).T - y) ** 2).sum()) for w, y in zip(weights, ref))
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


@register_method
class AWQ(WeightMethod):
    name, types = "awq", ("int", "float", "mxfp", "nvfp")
    needs = ("abs_mean", "samples")
    rotation_refusal = "its up_proj -> down_proj scale fold would cross the online R4 rotation"

    def __init__(self, n_grid: int = 20):
        self.n_grid = n_grid

    def transform(self, lm, stats, spec):
        """Search and fold one scale per fold group whose consumers are all being quantized."""
        groups = [g for g in fold_groups(lm.model) if all(n in stats for n in g.consumers)]
        alphas = {}
        for group in track(groups, description="awq scale search", transient=True):
            first = require_stats(self, stats[next(iter(group.consumers))])
            s, alphas[group.name] = search_scale(group, first, spec, self.n_grid)
            fold_scale(group, s)
            wide = group.consumer_scale(s)
            for layer_stats in {id(st): st for st in (stats[n] for n in group.consumers)}.values():
                layer_stats.scale_inputs(wide)
        return {"awq_alpha": alphas}

    def quantize_weight(self, weight, spec, stats=None):
        stats = require_stats(self, stats)
        x = stats.samples.float()
        return clip_search(weight, spec, output_error(x.T @ x, spec))
