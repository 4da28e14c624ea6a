"""plan's report: the plan dict (plan.plan, plan.plan_on_slice) as the text the CLI prints."""

from big_vit_lite.runtime.devices import GIB
from big_vit_lite.planner.formulas import USABLE_FRACTION


def _fmt_bytes(b: float) -> str:
  return f"{b / GIB:8.2f} GiB"


def _yes_no(fits):
  if fits:
    return "yes"
  return "NO"


def format_report(p: dict) -> str:
  """The plan as the CLI prints it."""
  k, micro, a = p["grad_accum_steps"], p["micro_batch"], p["arch"]
  microbatches, per_microbatch = "", ""
  if k > 1:
    microbatches = f" in {k} microbatches of {micro}"
    per_microbatch = f", per microbatch of {micro}"
  lines = [
      f"ViT {p['variant'] or 'custom'} (width {a['width']}, depth {a['depth']}, MLP "
      f"{a['mlp_dim']}, {a['num_heads']} heads, patch {a['patch_size']}) @ {p['res']}px "
      f"({p['tokens']} tokens), {p['num_params'] / 1e6:.1f}M params, global batch "
      f"{p['global_batch']} ({p['local_batch']}/device"
      f"{microbatches}), remat={p['remat']}, "
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
          f"(peak, kept for backward{per_microbatch})",
      ),
      ("input batch", "batch", ""),
      (
          "weight copies",
          "fsdp_gather",
          "(FSDP's gathered weights, on a TPU or GPU in the matmul dtype)",
      ),
  ):
    b = p[f"{key}_bytes_per_device"]
    if b or key not in ("ema", "grad_accum"):
      lines.append(f"  {name:<15} {_fmt_bytes(b)}  {note}".rstrip())
  lines.append(
      f"  total           {_fmt_bytes(p['total_bytes_per_device'])}  -> fits: "
      f"{_yes_no(p['fits'])} (limit {USABLE_FRACTION:.0%} of HBM)"
  )
  # Remat on a GPU goes with the blocks under scan (docs/gpu.md).
  advise_scan = p["platform"] == "gpu" and not p["scan"]
  if p["fits_with_remat"] is not None:
    with_remat = "does not fit with remat either"
    remat_flags = "--config.model.remat_policy=nothing_saveable"
    if advise_scan:
      remat_flags += " --config.model.scan=True"
    if p["fits_with_remat"]:
      with_remat = (
          f"fits with {remat_flags} (each block's forward recomputed: ~1/3 more "
          "block FLOPs)"
      )
    lines.append(
        f"  with remat      {_fmt_bytes(p['total_bytes_with_remat'])}  -> "
        + with_remat
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
  if advise_scan and p["remat"]:
    # Measured with the GPU compiler: benchmarks/NOTES.md, "Remat under scan".
    lines.append(
        "note: remat with the blocks unrolled: XLA:GPU may run every block's input "
        "gradients before their weight gradients and keep the recomputed activations "
        "in between (B/16 on 8x B200: 15.2 GiB per GPU, 9.0 under scan); add "
        "--config.model.scan=True"
    )
  if "tpu_topology" in p:
    lines += tpu_lines(p)
  if "gpu_host" in p:
    lines += gpu_lines(p)
  if "compiled_temp_bytes" in p:
    lines.append(
        f"compiled on {p['devices']} simulated CPU devices: arguments "
        f"{_fmt_bytes(p['compiled_argument_bytes'])}, temporaries "
        f"{_fmt_bytes(p['compiled_temp_bytes'])}, peak {_fmt_bytes(p['compiled_peak_bytes'])}; "
        f"FLOPs/device {p['compiled_flops_per_device']:.3e} (XLA), model FLOPs/step "
        f"{p['compiled_model_flops']:.3e} (jaxpr)"
    )
  return "\n".join(lines)


def _compiled_lines(
    p: dict, prefix: str, memory_key: str, spare_key: str
) -> list:
  """A compiler's memory per device, whether it fits, and its collectives: the
  `prefix`_* fields (tpu, gpu), the memory in p[memory_key], the spare in p[spare_key].
  """
  memory_b, fits = p[memory_key], _yes_no(p[f"{prefix}_fits"])
  lines = [
      f"  per device: arguments {p[f'{prefix}_argument_bytes'] / GIB:.2f} GiB, "
      f"outputs {p[f'{prefix}_output_bytes'] / GIB:.2f} GiB (aliased "
      f"{p[f'{prefix}_alias_bytes'] / GIB:.2f}), temporaries "
      f"{p[f'{prefix}_temp_bytes'] / GIB:.2f} GiB",
      f"  total {p[f'{prefix}_peak_bytes'] / GIB:.2f} of {memory_b / GIB:.1f} GiB "
      f"-> fits: {fits} ({p[spare_key]:.0%} spare)",
  ]
  for op, c in p[f"{prefix}_collectives"].items():
    if c["count"]:
      lines.append(
          f"  {op}: {c['count']} in the program, {c['bytes'] / GIB:.3f} GiB"
      )
  return lines


def tpu_lines(p: dict) -> list:
  """plan's report lines for the tpu_* fields."""
  head = (
      f"TPU compiler, {p['tpu_topology']} ({p['tpu_chips']} chips, "
      f"{p['devices']} devices)"
  )
  if "tpu_refused" in p:
    return [
        f"{head}: does NOT fit, the compiler refused the step: "
        + p["tpu_refused"]
    ]
  est_s = p["tpu_est_step_s"]
  estimate = "none for this program"
  if est_s:
    estimate = (
        f"step {est_s * 1e3:.1f} ms, {p['tpu_est_img_per_s_per_chip']:.1f} img/s per "
        f"chip, MFU {p['tpu_est_mfu']:.1%} (model FLOPs {p['tpu_model_flops']:.3e}/step)"
    )
  lines = [head] + _compiled_lines(p, "tpu", "tpu_hbm_bytes", "tpu_hbm_spare")
  lines.append(f"  estimated by the compiler's cost model: {estimate}")
  if all(p.get("tpu_est_by_depth") or [None]):
    lines.append(
        "  (the time of the unrolled step compiled at depth 1 and 2 ("
        + ", ".join(f"{t * 1e3:.3g} ms" for t in p["tpu_est_by_depth"])
        + f"), extrapolated to depth {p['arch']['depth']})"
    )
  elif est_s and p["tpu_loop_scale"] > 1.01:
    lines.append(
        f"  (loops in the program, nn.scan or grad_accum: the cost model's time is scaled "
        f"by their FLOPs, x{p['tpu_loop_scale']:.1f}, a rough figure; --time_by_depth "
        "extrapolates it from two shallow unrolled compiles)"
    )
  return lines


def gpu_lines(p: dict) -> list:
  """plan's report lines for the gpu_* fields."""
  head = (
      f"GPU compiler, {p['gpu_hosts']} x {p['gpu_host']} ({p['devices']} x "
      f"{p['gpu_name']}), {p['gpu_attention']} attention"
  )
  return [head] + _compiled_lines(p, "gpu", "gpu_memory_bytes", "gpu_spare")
