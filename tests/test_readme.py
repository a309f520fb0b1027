"""README's sample outputs are what HEAD prints (``tools/readme_samples.py``)."""
import pytest

from tools import readme_samples


def test_the_main_sample_is_what_python_m_kfac_graph_prints():
    assert readme_samples.check(["main"]) == {}


def test_the_memory_sample_is_what_the_estimator_summary_prints():
    assert readme_samples.check(["memory"]) == {}


@pytest.mark.slow
def test_the_verify_sample_is_what_kg_verify_prints():
    assert readme_samples.check(["verify"]) == {}


def test_only_drifting_figures_are_masked():
    written = "5 layers, 1,514 parameters\nstep   50  loss 1.0031\ntest accuracy after 200 steps: 0.911"
    drifted = "5 layers, 1,514 parameters\nstep   50  loss 1.1666\ntest accuracy after 200 steps: 0.894"
    assert readme_samples.differences("main", written, drifted) == []
    for wrong in (drifted.replace("1,514", "1,515"), drifted.replace("loss", "lost"),
                  drifted.replace("1.1666", "nan"), drifted + "\nstep  250  loss 0.1"):
        assert readme_samples.differences("main", written, wrong), wrong


def test_every_sample_block_in_readme_has_a_maker():
    text = readme_samples.README.read_text(encoding="utf-8")
    found = readme_samples.blocks(text)
    assert set(found) == set(readme_samples.SAMPLES)
    assert "kg.verify(loss_fn, x, y)" in found["verify"][2]
