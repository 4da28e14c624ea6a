"""Unknown `evals.NAME` keys: a one-line error naming this framework's key.

People bring evaluator configs from big_vision (`pp_fn`, `l2_reg`,
`pp_train`/`pp_eval`, `cache_final`, `pred`, `prefix`, ...). Each Evaluator
class is wrapped by `checked_keys`, so that an unknown key stops with a
TypeError that says what to write instead, or which key was probably meant,
and lists the keys the evaluator takes. (The trainer and evaluate turn it
into "config.evals.NAME (type T): ...".)
"""
import difflib
import functools
import inspect

# big_vision's evaluator keys -> ours, and what to do here.
_RENAMED = {"pp_fn": "pp", "pp_train": "pp", "pp_eval": "pp", "l2_reg": "l2_regs"}
_ADVICE = {
    **dict.fromkeys(("pp_train", "pp_eval"),
                    "one pp for both splits; per dataset: datasets.NAME.pp"),
    "l2_reg": "a list of values; the best is picked on the train split",
    "data_dir": "it goes in the data config: datasets.NAME.data_dir, or data.data_dir for "
                "classification",
    "display_first": "the printed table shows every dataset and shot count; remove it",
    **dict.fromkeys(("cache_final", "cache_raw", "cache"),
                    "big_vision's input caching; not needed here, remove it"),
    "prefetch": "big_vision's input prefetch; not needed here, remove it",
    "pred": "evals run the model's forward pass; remove it (representation_layer picks "
            "the features of fewshot and linear_probe)",
    "pred_kw": "evals run the model's forward pass; remove it",
    "prefix": "metrics are named after the evals entry (NAME/KEY): rename the entry instead",
    "skip_first": "evals run at step 0 only with the top-level eval_at_start=True; remove it",
    "devices": "evals use the config's mesh; remove it",
    "mask_key": "padding is masked by the pipeline itself; remove it",
    "loss_name": "only the classification eval has a loss; remove it",
    "label_key": "this eval reads 'labels' (one-hot) or else 'label' (integer); rename the "
                 "key in the pp, e.g. rename('my_label', 'label')",
    "outfile": "results go to WORKDIR/metrics.jsonl; remove it",
}


def _hint(key, known):
  renamed, advice = _RENAMED.get(key), _ADVICE.get(key)
  if renamed in known:
    return f" (this framework calls it '{renamed}'" + (f": {advice})" if advice else ")")
  if advice:
    return f" ({advice})"
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
  return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_keys_message(keys, known):
  """"evaluator key 'pp_fn' is unknown (this framework calls it 'pp'); it takes ..."

  All of them at once: a config brought from big_vision has several.
  """
  named = ", ".join(f"'{k}'{_hint(k, known)}" for k in keys)
  one = len(keys) == 1
  return (f"evaluator {'key' if one else 'keys'} {named} {'is' if one else 'are'} unknown; it "
          f"takes {', '.join(sorted(known))}.")


def checked_keys(cls):
  """Class decorator: unknown keyword arguments of __init__ raise a hinting TypeError."""
  init = cls.__init__
  known = [name for name, p in inspect.signature(init).parameters.items()
           if p.kind == p.KEYWORD_ONLY and name != "mesh"]

  @functools.wraps(init)
  def checked_init(self, *args, **kwargs):
    if unknown := [k for k in kwargs if k not in known and k != "mesh"]:
      raise TypeError(unknown_keys_message(unknown, known))
    init(self, *args, **kwargs)

  cls.__init__ = checked_init
  return cls
