"""The quantized-checkpoint writer: writer.py (`write_quantized`: AWQ / GPTQ / FP8 / MXFP4 / W8A8 files that
other tools read), calibrate.py (GPTQ and AWQ calibration); `python -m tritonq.quantize` runs it."""
