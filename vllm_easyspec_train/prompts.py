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


# More tasks, each asked in three of the Python templates (a second block, so that the
# first 520 prompts stay what they were).
_TASKS_2 = [
    "computes the Levenshtein ratio between two strings",
    "finds the most frequent element in a list",
    "splits a list into chunks of size n",
    "transposes a matrix given as a list of lists",
    "checks whether two strings are anagrams",
    "computes the power set of a list",
    "generates all combinations of k elements from a list",
    "finds the missing number in a list containing 0..n",
    "implements a min-heap class with push and pop",
    "implements a queue using two stacks",
    "converts a decimal number to binary without bin()",
    "finds the second largest number in a list",
    "checks whether parentheses in a string are balanced",
    "evaluates an arithmetic expression in reverse Polish notation",
    "implements a trie with insert and prefix search",
    "finds connected components in an undirected graph",
    "computes Dijkstra's shortest paths from a source node",
    "performs a topological sort of a dependency graph",
    "implements union-find with path compression",
    "computes the maximum subarray sum (Kadane's algorithm)",
    "solves the 0/1 knapsack problem with dynamic programming",
    "computes the number of ways to climb n stairs taking 1 or 2 steps",
    "finds the longest palindromic substring",
    "counts the vowels and consonants in a string",
    "capitalizes the first letter of every word in a sentence",
    "reads a text file and prints the lines that contain a keyword",
    "writes a list of dictionaries to a CSV file",
    "downloads nothing but simulates a progress bar for a list of tasks",
    "measures the execution time of a function with a decorator",
    "caches function results with a memoization decorator",
    "validates a password against length, digit and symbol rules",
    "generates a random password of a given length",
    "converts a temperature between Celsius and Fahrenheit",
    "computes the factorial of n with recursion and checks the input",
    "checks whether a year is a leap year",
    "computes the day of the week for a given date",
    "computes the mean, median and mode of a list of numbers",
    "normalizes a list of numbers to the range 0..1",
    "computes the dot product and the cosine similarity of two vectors",
    "multiplies two matrices given as lists of lists",
    "finds all pairs in a list that sum to a target",
    "checks whether a list is a permutation of 1..n",
    "rotates a list to the right by k positions",
    "deep-merges two nested dictionaries",
    "flattens a nested dictionary into dotted keys",
    "inverts a dictionary that maps keys to lists of values",
    "counts the occurrences of each character in a string",
    "removes all whitespace from a string",
    "converts snake_case identifiers to camelCase",
    "checks whether a number is an Armstrong number",
    "generates Pascal's triangle up to n rows",
    "finds the intersection of two lists",
    "implements a circular buffer with a fixed size",
    "implements a simple event emitter with subscribe and emit",
    "implements a thread-safe counter with a lock",
    "runs several functions in parallel with concurrent.futures",
    "parses command-line arguments with argparse for a file-copy tool",
    "logs messages to a file with the logging module and rotates it",
    "loads environment variables with defaults into a settings object",
    "hashes a file's contents with SHA-256 in chunks",
    "encodes and decodes a string with base64",
    "implements a Caesar cipher with encrypt and decrypt",
    "computes the Hamming distance between two integers",
    "samples k items uniformly from a stream (reservoir sampling)",
]

_PYTHON_TEMPLATES = [0, 1, 2, 3, 4, 9]  # indices into _TEMPLATES


def train_prompts() -> list[str]:
    """Deterministic list of the training prompts (712 prompts).

    The first 520 (``_TASKS`` in every template, plus ``_EXTRA``) and the next 192
    (``_TASKS_2`` in three Python templates each) are each shuffled with a fixed
    seed, so that any prefix (``--num-prompts N``) mixes tasks, languages and
    styles, and ``--num-prompts 520`` gives the first block unchanged.
    """
    import random

    first = [tpl.format(t=t) for t in _TASKS for tpl in _TEMPLATES]
    first.extend(_EXTRA)
    random.Random(20240501).shuffle(first)
    second = [_TEMPLATES[_PYTHON_TEMPLATES[(i + j) % len(_PYTHON_TEMPLATES)]].format(t=t)
              for i, t in enumerate(_TASKS_2) for j in (0, 2, 4)]
    random.Random(20261122).shuffle(second)
    return first + second


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
