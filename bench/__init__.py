"""Benchmarks: load generation, CPU interference, reports. Imports the packages;
never imported by them. Results are committed under bench/results/."""
