"""docs/configuration.md is what the config classes give: every option of every experiment, with its default and
help (``python -m realhf.apps.config_docs`` writes it)."""
from realhf.apps.config_docs import DEFAULT_PATH, render


def test_configuration_page_is_current():
    with open(DEFAULT_PATH, encoding="utf-8") as f:
        current = f.read()
    assert current == render(), ("docs/configuration.md is out of date with the config classes: run "
                                 "python -m realhf.apps.config_docs and commit the page")

