"""plan's report: the plan dict (plan.plan, plan.plan_on_slice) as the text the CLI prints."""

from big_vit_lite.devices import GIB
from big_vit_lite.planner import gpu
from big_vit_lite.planner import tpu
from big_vit_lite.planner.formulas import USABLE_FRACTION


def _fmt_bytes(b: float) -> str:
  return f"{b / GIB:8.2f} GiB"


def format_report(p: dict) -> str:
  """The plan as the CLI prints it."""
  k, micro, a = p["grad_accum_steps"], p["micro_batch"], p["arch"]
  lines = [
      f"ViT {p['variant'] or 'custom'} (width {a['width']}, depth {a['depth']}, MLP "
      f"{a['mlp_dim']}, {a['num_heads']} heads, patch {a['patch_size']}) @ {p['res']}px "
      f"({p['tokens']} tokens), {p['num_params'] / 1e6:.1f}M params, global batch "
      f"{p['global_batch']} ({p['local_batch']}/device"
      f"{f' in {k} microbatches of {micro}' if k > 1 else ''}), remat={p['remat']}, "
      f"matmuls in {p['dtype_mm']}, residual stream in {p['dtype_act']}, "
      f"{p['attention']} attention",
      f"mesh {','.join(f'{n}:{v}' for n, v in p['mesh'].items())} = {p['devices']} x "
      f"{p['device']} ({p['hbm_bytes'] / GIB:.0f} GiB each)",
      "per device:",
  ]
  for name, key, note in (
      ("params", "params", ""),
      ("optimizer state", "opt", ""),
      ("gradients", "grad", ""),
      ("EMA of params", "ema", "(config.ema_decay)"),
      (
          "accumulator",
          "grad_accum",
          f"(f32 gradient sum over the {k} microbatches)",
      ),
      (
          "activations",
          "act",
          "(peak, kept for backward"
          + (f", per microbatch of {micro})" if k > 1 else ")"),
      ),
      ("input batch", "batch", ""),
      (
          "weight copies",
          "fsdp_gather",
          "(FSDP's gathered weights; on a TPU also bf16 copies)",
      ),
  ):
    b = p[f"{key}_bytes_per_device"]
    if b or key not in ("ema", "grad_accum"):
      lines.append(f"  {name:<15} {_fmt_bytes(b)}  {note}".rstrip())
  lines.append(
      f"  total           {_fmt_bytes(p['total_bytes_per_device'])}  -> fits: "
      f"{'yes' if p['fits'] else 'NO'} (limit {USABLE_FRACTION:.0%} of HBM)"
  )
  if p["fits_with_remat"] is not None:
    lines.append(
        f"  with remat      {_fmt_bytes(p['total_bytes_with_remat'])}  -> "
        + (
            "fits with --config.model.remat_policy=nothing_saveable (each block's forward "
            "recomputed: ~1/3 more block FLOPs)"
            if p["fits_with_remat"]
            else "does not fit with remat either"
        )
    )
  lines += [
      f"FLOPs per step: {p['flops_per_step']:.3e} model (matmuls, as MFU counts them), "
      f"{p['hw_flops_per_step']:.3e} with remat's recomputation",
      f"step time >= {p['step_time_s'] * 1e3:.1f} ms (compute at peak "
      f"{p['compute_time_s'] * 1e3:.1f} ms, collectives {p['comm_time_s'] * 1e3:.1f} ms); "
      f"MFU bound {p['mfu_bound']:.2f}",
  ]
  if p["ignored_px"]:
    lines.append(
        f"note: {p['res']} px is not a multiple of the patch size "
        f"{a['patch_size']}: the patchify ignores the last {p['ignored_px']} "
        "px rows and columns of every image"
    )
  if p["unsplit_params"]:
    lines.append(
        f"note: param dims not divisible by their mesh axes (split as in training): "
        f"{'; '.join(p['unsplit_params'])}"
    )
  if "tpu_topology" in p:
    lines += tpu.format_lines(p)
  if "gpu_host" in p:
    lines += gpu.format_lines(p)
  if "compiled_temp_bytes" in p:
    lines.append(
        f"compiled on {p['devices']} simulated CPU devices: arguments "
        f"{_fmt_bytes(p['compiled_argument_bytes'])}, temporaries "
        f"{_fmt_bytes(p['compiled_temp_bytes'])}, peak {_fmt_bytes(p['compiled_peak_bytes'])}; "
        f"FLOPs/device {p['compiled_flops_per_device']:.3e} (XLA), model FLOPs/step "
        f"{p['compiled_model_flops']:.3e} (jaxpr)"
    )
  return "\n".join(lines)
