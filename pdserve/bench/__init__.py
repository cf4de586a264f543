"""`pdserve bench`: load against OpenAI-compatible endpoints, and P/D vs colocated side by side.

Driven by vLLM's own benchmark library (`vllm.benchmarks`: its datasets, Poisson
arrivals, streaming request functions and metric definitions); pdserve adds
workload mixes, multi-turn sessions, SLO goodput, deployments and plots.
"""
