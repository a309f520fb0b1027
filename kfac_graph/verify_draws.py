"""Random draws in the loss, as ``kg.verify`` reads them.

A loss that draws random numbers (dropout, noise layers, random
augmentation) draws once per run: ``kg.per_example_gradients`` gives each
example's gradient under that run's draw (example ``i``'s share of the
batch's masks), and their mean (or sum) is that run's batch gradient.

- one-example: a batch of one draws its own numbers, of another shape, so
  no batch-of-one gradient is of the batch's draw: skipped;
- mean (or sum): every run of ``fn`` starts from the variables' saved values
  (``verify_state``), the random state included where it is a variable
  (Keras 3's seed generators, ``tf.random.Generator``, tf_keras with
  ``enable_tf_random_generator``), so each run draws alike and the check
  compares one draw. Ops that keep their state in the kernel
  (``tf.random.uniform``, tf_keras's default ``Dropout``) draw anew on
  every run of a function: there the check is skipped too. The batch
  gradient is that of the registration's own trace of ``fn``: a loss may draw when traced, too (Keras's
  ``AugMix`` picks each chain's ops by Python's ``random.choice``), and then
  every trace computes another loss; a reference traced anew compared the
  per-example gradients with another loss's gradient and FAILED the mean
  (``verify`` differentiates ``fn.concrete_function(*args)`` there).
"""
from __future__ import annotations

# op types that draw (the key and algorithm lookups draw nothing)
_DRAWS = ("Random", "Multinomial", "TruncatedNormal", "StatefulUniform",
          "StatefulStandardNormal")
_NOT_DRAWS = ("GetKeyCounter", "GetAlg", "GetKey")
# state in a resource variable, or a key passed in: restorable, so one draw per state
_KEYED = ("Stateless", "Stateful")


def drawing_ops(reg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(every op type in the loss that draws, those keeping their state in
    the kernel)``, sorted."""
    ops = {d["op"] for _, d in (reg.ir.nodes(data=True) if reg.ir is not None else ())}
    drawn = sorted(op for op in ops if any(d in op for d in _DRAWS)
                   and not any(n in op for n in _NOT_DRAWS))
    return tuple(drawn), tuple(op for op in drawn if not op.startswith(_KEYED))


def note(drawn, kernel_state) -> list[str]:
    """The report's note on the draws (none without any)."""
    if not drawn:
        return []
    if kernel_state:
        how = (f"ops {', '.join(kernel_state)} keep their state in the kernel and draw anew on "
               "every run, so the mean (or sum) is skipped too (a seed generator held in a "
               "variable, as Keras 3's layers have, makes every run draw alike)")
    else:
        how = ("every run starts from the same random state (the variables are restored), "
               "so the mean (or sum) compares the per-example gradients with the batch "
               "gradient of the same draw")
    return [f"the loss draws random numbers ({', '.join(drawn)}): a batch of one draws its "
            f"own, so one-example is skipped; {how} (dropout? call the model with "
            "training=False to check the rest)"]

