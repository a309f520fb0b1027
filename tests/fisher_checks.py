"""Assertions that compare kfac_graph's Fisher blocks and estimators with a
reference (a dense matrix from ``fisher_reference``, or another estimator)."""

import numpy as np
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import operator_matrix


def assert_damped_products(block, damped):
    """``block.multiply`` is the dense ``damped`` and ``block.multiply_inverse``
    its inverse (the block's inverses refreshed first)."""
    block.update_inverses()
    shapes = block.var_shapes
    np.testing.assert_allclose(operator_matrix(block.multiply, shapes), damped, rtol=1e-9,
                               atol=1e-10)
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, shapes),
                               np.linalg.inv(damped), rtol=1e-7, atol=1e-9)


def updated_estimators(fn, args, choices, estimation_mode="exact"):
    """One ``kg.FisherEstimator`` per ``approximations`` choice, each updated
    on ``args`` and its inverses refreshed."""
    ests = [kg.FisherEstimator(fn, estimation_mode=estimation_mode, approximations=choice)
            for choice in choices]
    for est in ests:
        est.update(*args)
        est.update_inverses()
    return ests


def assert_same_inverse_products(est, reference, variables, rng):
    """``est.multiply_inverse`` equals ``reference``'s on random vectors."""
    vs = [tf.constant(rng.normal(size=v.shape)) for v in variables]
    for got, want in zip(est.multiply_inverse(vs), reference.multiply_inverse(vs)):
        np.testing.assert_allclose(got, want, rtol=1e-9)

