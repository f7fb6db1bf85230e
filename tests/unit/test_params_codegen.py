"""The params tables are the one definition; the typed accessors IDEs see are generated
from them and must be current."""

import inspect
import typing

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("torch")

from spark_dl.spark.common import params_codegen  # noqa: E402
from spark_dl.spark.common.params import ESTIMATOR_PARAMS, MODEL_PARAMS  # noqa: E402


def test_generated_accessors_match_the_tables(capsys):
    assert params_codegen.main(["--check"]) == 0, capsys.readouterr().out


def test_estimators_and_models_get_explicit_typed_accessors():
    from spark_dl.spark.torch import TorchEstimator, TorchModel
    from spark_dl.spark.torch.params import TORCH_MODEL_PARAMS, TORCH_PARAMS

    for cls, tables in ((TorchEstimator, ESTIMATOR_PARAMS + TORCH_PARAMS),
                        (TorchModel, MODEL_PARAMS + TORCH_MODEL_PARAMS)):
        for spec in tables:
            for stem in spec.stems:
                getter = getattr(cls, f"get{stem}")
                # written out (generated, or by hand where a class refines one), not made
                # at run time
                assert not getattr(getter, "_spark_dl_generated", False), (cls, stem)
                hints = typing.get_type_hints(getter, globalns=vars(
                    inspect.getmodule(getter)), localns={"Store": object, "Backend": object})
                assert "return" in hints, (cls, stem)
    est = TorchEstimator(batch_size=7)
    assert est.setEpochs(3) is est and est.getEpochs() == 3 and est.getBatchSize() == 7
    assert est.setShufflingBufferSize(5).getShuffleBufferSize() == 5  # Horovod's spelling


def test_a_stale_table_is_reported(tmp_path, monkeypatch, capsys):
    from spark_dl.spark.common import params as params_module

    extra = params_module.ParamSpec("brand_new", "a row nobody generated", 1,
                                    params_module._int("brand_new"))
    monkeypatch.setattr(params_module, "ESTIMATOR_PARAMS", ESTIMATOR_PARAMS + (extra,))
    assert params_codegen.main(["--check"]) == 1
    assert "params_accessors.py" in capsys.readouterr().out
    text = params_codegen.render(params_codegen.OUTPUTS[
        "spark_dl/spark/common/params_accessors.py"])
    assert "def getBrandNew(self) -> Optional[int]:" in text
