"""Branching Policy Optimization (BPO) for verl."""
