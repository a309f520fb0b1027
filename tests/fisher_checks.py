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


def assert_all_products(block, damped):
    """``assert_damped_products``, and the block's matrix powers (1/2, -1/2)
    and Cholesky factor (and their transposes and inverses) against the dense
    ``damped``; returns the Cholesky factor as a matrix."""
    assert_damped_products(block, damped)
    shapes = block.var_shapes
    half = operator_matrix(lambda v: block.multiply_matpower(v, 0.5), shapes)
    np.testing.assert_allclose(half @ half, damped, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(operator_matrix(lambda v: block.multiply_matpower(v, -0.5), shapes),
                               np.linalg.inv(half), rtol=1e-6, atol=1e-8)
    chol = operator_matrix(block.multiply_cholesky, shapes)
    np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(operator_matrix(lambda v: block.multiply_cholesky(v, True), shapes),
                               chol.T, atol=1e-10)
    np.testing.assert_allclose(operator_matrix(block.multiply_cholesky_inverse, shapes),
                               np.linalg.inv(chol), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(
        operator_matrix(lambda v: block.multiply_cholesky_inverse(v, True), shapes),
        np.linalg.inv(chol.T), rtol=1e-7, atol=1e-9)
    return chol


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



def block_matrix(fn, args, layer, kind, approximation=None, estimation_mode="exact", **options):
    """The matrix of ``layer``'s block in a ``kg.FisherEstimator`` whose
    ``kind`` layers take ``approximation`` (None: the default), updated once
    on ``args`` (no moving average); ``options`` go to the estimator."""
    est = kg.FisherEstimator(fn, estimation_mode=estimation_mode, cov_ema_decay=0.0,
                             approximations={kind: approximation} if approximation else None,
                             **options)
    est.update(*args)
    return est.blocks[list(est.layers).index(layer)].full_matrix().numpy()
