"""Prompt sets written for this project (no external data).

``train_prompts()`` is used for self-distillation: the target answers each prompt
and the head learns from the target's own responses.  ``HELDOUT_PROMPTS`` are
disjoint from the training prompts (different tasks *and* wording) and are used
for the held-out benchmark only.
"""

from __future__ import annotations

_TASKS = [
    "reverses a singly linked list",
    "checks whether a string is a palindrome, ignoring punctuation",
    "merges two sorted lists into one sorted list",
    "computes the n-th Fibonacci number iteratively",
    "parses a CSV line that may contain quoted fields",
    "finds the longest common prefix of a list of strings",
    "implements binary search on a sorted array",
    "counts word frequencies in a text file",
    "flattens an arbitrarily nested list",
    "validates an IPv4 address",
    "implements an LRU cache with a fixed capacity",
    "converts a Roman numeral to an integer",
    "computes the greatest common divisor of two integers",
    "removes duplicate entries from a list while keeping order",
    "rotates a square matrix by 90 degrees",
    "implements a stack with push, pop and min in O(1)",
    "groups anagrams from a list of words",
    "finds all prime numbers below n with a sieve",
    "serializes a binary tree to a string and back",
    "computes the edit distance between two strings",
    "implements quicksort",
    "implements merge sort",
    "detects a cycle in a directed graph",
    "performs a breadth-first search on a grid maze",
    "finds the k largest elements of a list with a heap",
    "reads a JSON config file and validates required keys",
    "retries a function call with exponential backoff",
    "implements a simple token bucket rate limiter",
    "computes a running median of a stream of numbers",
    "converts a snake_case identifier to camelCase",
    "builds a trie and supports prefix search",
    "implements Dijkstra's shortest path algorithm",
    "computes the transpose of a matrix given as nested lists",
    "formats a number of bytes as a human readable string",
    "splits a list into chunks of a given size",
    "checks whether parentheses in an expression are balanced",
    "implements a thread-safe counter",
    "downloads nothing but simulates a job queue with worker threads",
    "evaluates a postfix (reverse Polish) arithmetic expression",
    "computes the power set of a small set",
    "finds the maximum subarray sum (Kadane's algorithm)",
    "implements a min-heap from scratch",
    "parses command line arguments for a file-copy tool",
    "computes moving averages over a sliding window",
    "topologically sorts tasks with dependencies",
    "encodes and decodes run-length encoding",
    "merges overlapping intervals",
    "generates all permutations of a string",
    "implements a simple key-value store backed by a dict with TTL expiry",
    "computes the determinant of a 3x3 matrix",
]

_TEMPLATES = [
    "Write a Python function that {t}. Include a docstring.",
    "Write a Python function that {t}, then show a short usage example.",
    "Implement a Python class or function that {t}. Add type hints.",
    "Write pytest unit tests for a function that {t}.",
    "Explain step by step how to write code that {t}, then give the Python code.",
    "Write a JavaScript function that {t}.",
    "Write a C++ function that {t}.",
    "Write a Go function that {t}.",
    "Write a Rust function that {t}.",
    "What is the time complexity of a function that {t}? Show a Python implementation.",
]

_EXTRA = [
    "Explain the difference between a list and a tuple in Python.",
    "Explain what a Python decorator is and give an example.",
    "Explain how Python's GIL affects multithreaded programs.",
    "What are Python generators? Give two examples.",
    "Explain list comprehensions with examples.",
    "How do context managers work in Python? Write one with a class and one with contextlib.",
    "Explain the difference between `is` and `==` in Python.",
    "Write a bash script that backs up a directory into a timestamped tar.gz file.",
    "Write a SQL query that returns the top 5 customers by total order amount.",
    "Write a Dockerfile for a small Flask application.",
    "Explain what a REST API is and show a minimal example with FastAPI.",
    "Explain big-O notation with examples.",
    "Write a regular expression that matches an email address and explain it.",
    "Explain how git rebase differs from git merge.",
    "Write a Python dataclass for a 2D point with distance and addition methods.",
    "Explain asyncio in Python with a small example that runs three tasks concurrently.",
    "Write a Makefile for a small C project with two source files.",
    "Explain recursion and show a recursive and an iterative factorial.",
    "Write an HTML page with a form that posts a name and an email.",
    "Explain the difference between processes and threads.",
]


def train_prompts() -> list[str]:
    """Deterministic list of the training prompts (520 prompts), shuffled with a fixed
    seed so that any prefix (``--num-prompts N``) mixes tasks, languages and styles."""
    import random

    out = [tpl.format(t=t) for t in _TASKS for tpl in _TEMPLATES]
    out.extend(_EXTRA)
    random.Random(20240501).shuffle(out)
    return out


# Held out: tasks that appear nowhere in the training prompts.
HELDOUT_PROMPTS = [
    "Write a Python function that checks whether a Sudoku board is valid.",
    "Write a Python function that converts an integer to its English words representation.",
    "Implement a Python function that computes the longest increasing subsequence of a list.",
    "Write a Python class for a bank account with deposit, withdraw and a transaction history.",
    "Write a Python function that parses a URL query string into a dictionary.",
    "Write a Python function that finds the shortest word ladder between two words.",
    "Write a Python script that walks a directory tree and reports the ten largest files.",
    "Write a Python function that computes the convex hull of a set of 2D points.",
    "Implement Conway's Game of Life step function in Python using lists.",
    "Write a Python function that wraps text to a given line width without breaking words.",
    "Write a Python function that computes the checksum of an ISBN-13 number.",
    "Implement a Python iterator class that yields the lines of a file in reverse order.",
    "Write a Python function that converts a Markdown table into a list of dictionaries.",
    "Write a Python function that solves the N-queens problem and returns one solution.",
    "Write a Python function that schedules meetings into the minimum number of rooms.",
    "Write a Python function that compresses a string like 'aaabcc' into 'a3b1c2'.",
]
