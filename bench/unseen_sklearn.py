#!/usr/bin/env python3
"""Export scikit-learn models with skl2onnx, for bench/unseen.py (not a test).

Run by a Python that has scikit-learn and skl2onnx (bench/unseen.py finds one through
$SURGEON_SKL_PYTHON, else tries its own interpreter; the project does not depend on either):

    python bench/unseen_sklearn.py OUT_DIR

Writes OUT_DIR/<name>.onnx, each fitted on a fixed seed's data of sklearn's bundled digits set
(64 features, 10 classes; no download):
  skl_mlp_op9    MLPClassifier 64-256-128-10 at opset 9 / ai.onnx.ml 1 (MatMul weights, ZipMap output)
  skl_forest     RandomForestClassifier (TreeEnsembleClassifier: every weight an attribute, ZipMap)
  skl_logreg     StandardScaler (Scaler) + LogisticRegression (LinearClassifier: coefficients in attributes, ZipMap)
  skl_ridge_f64  StandardScaler + PCA + Ridge on float64 (float64 initializers, standard ops)
  skl_knn        KNeighborsClassifier (the training set as a float initializer, TopK over distances)
"""
import sys
from pathlib import Path

import numpy as np
from skl2onnx import to_onnx
from sklearn.datasets import load_digits
from sklearn.decomposition import PCA
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.neighbors import KNeighborsClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    x, y = load_digits(return_X_y=True)
    x32 = x.astype(np.float32)
    models = {
        "skl_mlp_op9": (MLPClassifier((256, 128), max_iter=60, random_state=0).fit(x32, y), x32,
                        {"": 9, "ai.onnx.ml": 1}),
        "skl_forest": (RandomForestClassifier(40, max_depth=10, random_state=0).fit(x32, y), x32, None),
        "skl_logreg": (make_pipeline(StandardScaler(), LogisticRegression(max_iter=300)).fit(x32, y), x32, None),
        "skl_ridge_f64": (make_pipeline(StandardScaler(), PCA(32, random_state=0), Ridge()).fit(x, y.astype(np.float64)),
                          x, None),
        "skl_knn": (KNeighborsClassifier(5).fit(x32[:1200], y[:1200]), x32, None),
    }
    for name, (est, xs, opset) in models.items():
        onx = to_onnx(est, xs[:1], target_opset=opset) if opset else to_onnx(est, xs[:1])
        (out / f"{name}.onnx").write_bytes(onx.SerializeToString())
        print(name, (out / f"{name}.onnx").stat().st_size)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
