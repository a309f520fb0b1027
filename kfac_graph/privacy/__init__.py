"""Differential privacy for training: accounting, sampling, clipping, noise and
Keras ``fit``.

    import kfac_graph as kg
    sigma = kg.privacy.noise_for_epsilon(3.0, 1e-5, epochs=20, num_examples=n, batch_size=64)
    batches = kg.privacy.poisson_batches((x, y), rate=64 / n)       # (x, y, mask)
    model = kg.DPModel(keras_model, loss=..., l2_norm_clip=1.0, noise_multiplier=sigma,
                       delta=1e-5)
    model.compile(optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"])
    model.fit(batches, epochs=20)                                    # logs epsilon
    print(kg.privacy.statement(sigma, 1e-5, epochs=20, num_examples=n, batch_size=64))

Modules: ``accounting`` (epsilon by RDP or PLD, noise calibration, the
statement; which accountant goes with which sampler), ``ledger`` (phases
of training at other rates or noise, composed; ``StepAccountant``), ``sampling``
(``poisson_batches``, ``fixed_size_batches``), ``clipping`` (flat, per layer,
per group, automatic), ``noise`` (Philox keyed from OS entropy), ``gradients``
(the privatised gradient), ``keras_model`` (``DPModel``).
"""
from kfac_graph.privacy.accounting import (ACCOUNTANTS, SAMPLINGS, Sampling, epsilon,
                                           noise_for_epsilon, statement)
from kfac_graph.privacy.ledger import StepAccountant
from kfac_graph.privacy.clipping import ClipPlan
from kfac_graph.privacy.noise import NoiseSource
from kfac_graph.privacy.sampling import fixed_size_batches, poisson_batches

__all__ = ["epsilon", "noise_for_epsilon", "statement", "Sampling", "StepAccountant",
           "SAMPLINGS", "ACCOUNTANTS", "poisson_batches", "fixed_size_batches", "ClipPlan",
           "NoiseSource"]
