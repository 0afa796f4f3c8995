"""GPU benchmarks (the WebGPU EP on an NVIDIA H200 beside PyTorch); run on the device machine."""
