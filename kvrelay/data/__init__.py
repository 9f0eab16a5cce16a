"""Benchmark data files and task scoring (GSM8K, MMLU, HumanEval); usable from pipeline and eval."""
