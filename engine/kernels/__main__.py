"""`python -m engine.kernels`: build the compiled CPU kernels now (make setup does) and say which path runs."""

from engine.kernels import available

print("kvscope CPU kernels:", "built" if available() else "unavailable: the pure PyTorch path runs")
