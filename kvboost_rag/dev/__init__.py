"""Development support: what tests and benchmarks use and the library itself never imports."""
