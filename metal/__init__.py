"""Metal kernel sources (*.metal), read as data by mlxspec.quant.kernels and the test harness."""
