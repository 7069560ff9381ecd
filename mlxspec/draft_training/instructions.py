"""The built-in instruction set a feature draft is trained on (the target answers them itself).

Instructions are made from task templates crossed with subjects, in five kinds a chat model is
asked for: chat answers, code, lists, reasoning and editing. ``held_out()`` are instructions on
subjects that no training instruction mentions, so the measured acceptance is not memorisation.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "volcanoes",
    "the water cycle", "machine learning", "the Roman Empire", "climate change", "vaccines",
    "the stock market", "electric cars", "the human heart", "recycling", "the moon landing",
    "honey bees", "the internet", "democracy", "earthquakes", "coffee", "sleep", "chess",
    "the piano", "solar panels", "the Great Wall of China", "DNA", "inflation", "rainbows",
    "the printing press", "antibiotics", "gravity", "the Olympic Games", "bread baking",
    "ocean tides", "time zones", "the immune system", "jazz music", "glaciers", "bicycles",
    "the Renaissance", "public libraries", "nuclear energy", "dinosaurs", "the metric system",
    "penguins", "rain forests", "smartphones", "the Industrial Revolution", "meditation",
    "wind turbines", "tea", "the periodic table", "airplanes", "mountains", "coral reefs",
]
HELD_OUT_SUBJECTS = [
    "lighthouses", "the Silk Road", "octopuses", "batteries", "origami", "the Amazon river",
    "comets", "cheese making", "submarines", "the Moon's phases", "hurricanes", "the violin",
]
CHAT = [
    "Explain {s} to a ten-year-old.", "What is {s}? Answer in a short paragraph.",
    "Write a short blog post about {s}.", "Why is {s} important?",
    "Give me three interesting facts about {s}.", "Summarize the history of {s}.",
    "Write a friendly email to a colleague about {s}.", "Describe {s} in simple words.",
    "Write a short poem about {s}.", "What are common misconceptions about {s}?",
]
LISTS = [
    "List five key points about {s}.", "Give a numbered list of questions a student might ask "
    "about {s}.", "Make a bullet list of pros and cons of {s}.",
    "List the main steps to learn about {s}.", "Write a glossary of five terms related to {s}.",
]
EDIT = [
    "Rewrite this sentence to be more formal: '{s} is really cool and everyone should know "
    "about it.'", "Fix the grammar: '{s} are a thing what many peoples is study since long "
    "time.'", "Translate into simple English: 'The study of {s} constitutes a multifaceted "
    "endeavour.'", "Make this title catchier: 'Some information about {s}'.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the words in a text", "sorts a list of numbers "
    "with bubble sort", "finds the largest element of a list", "removes duplicates from a list",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "merges two sorted lists", "computes the average of a list", "reads a file and prints its "
    "lines", "counts the vowels in a string", "returns the greatest common divisor of two "
    "numbers", "flattens a nested list", "implements binary search", "capitalizes every word",
    "validates an email address", "computes the sum of digits of a number",
]
CODE = [
    "Write a Python function that {t}.", "Write a JavaScript function that {t}.",
    "Explain how to write a program that {t}, then show the code in Python.",
    "Write a Python function that {t}, with a docstring and an example.",
    "Write a C function that {t}.",
]
REASONING = [
    "If a train travels at {a} km/h for {b} hours, how far does it go? Explain step by step.",
    "A shop sells pens at {a} cents each. How much do {b} pens cost? Show your work.",
    "What is {a} times {b}? Explain how you computed it.",
    "Tom has {a} apples and gives away {b}. How many are left? Think step by step.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If I save {a} dollars a week, how much will I have after {b} weeks?",
    "Is {a} larger than {b} squared? Explain.", "What is {a} percent of {b}? Explain.",
]


def _subject_instructions(subjects: list[str]) -> list[str]:
    return [t.format(s=s) for s in subjects for t in CHAT + LISTS + EDIT]


def _code_instructions(tasks: list[str]) -> list[str]:
    return [t.format(t=task) for task in tasks for t in CODE]


def _reasoning_instructions(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(REASONING).format(a=rng.randint(2, 99), b=rng.randint(2, 30))
            for _ in range(n)]


def training_instructions(seed: int = 0) -> list[str]:
    """The built-in training instructions (about 1,300), shuffled with ``seed``."""
    rng = random.Random(seed)
    items = (_subject_instructions(SUBJECTS) + _code_instructions(CODE_TASKS[:-4])
             + _reasoning_instructions(rng, 200))
    rng.shuffle(items)
    return items


def held_out(n: int = 24, seed: int = 1) -> list[str]:
    """``n`` held-out instructions of every kind, on subjects and tasks training never saw."""
    rng = random.Random(seed)
    subject = _subject_instructions(HELD_OUT_SUBJECTS)
    code = _code_instructions(CODE_TASKS[-4:])
    reasoning = _reasoning_instructions(random.Random(seed + 100), 40)
    rng.shuffle(subject)
    rng.shuffle(code)
    picks = []
    for i in range(n):  # chat/list/edit, code, reasoning in turn
        picks.append([subject, code, reasoning][i % 3][i // 3])
    return picks
