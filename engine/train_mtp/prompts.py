"""train-mtp prompts: the training and held-out templates x topics, generated tasks
(arithmetic, code, letters), sampling temperatures, and chat-templated token ids."""
from __future__ import annotations

import random

TRAIN_TEMPLATES = [
    "Explain {t} to a beginner.", "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?", "Give me a simple overview of {t}.",
    "Why is {t} important?", "Describe {t} in a few sentences.",
    "What should a student know about {t}?", "Summarize the history of {t}.",
    "List some pros and cons of {t}.", "How would you teach a child about {t}?",
    "Write a short story that involves {t}.", "What are common misconceptions about {t}?",
    "Compare {t} with something similar.", "Write a haiku about {t}.",
    "What questions do people often ask about {t}?", "Give practical tips related to {t}.",
    "How has {t} changed over time?", "Write an encouraging note about learning {t}.",
    "Explain {t} using an analogy.", "What are the main parts of {t}?",
    "Tell me a fun fact about {t}.", "Explain how {t} works.", "Write a short poem about {t}.",
    "Give an example of {t} in everyday life.", "What are the benefits of {t}?",
    "What are the risks or downsides of {t}?", "Write a tweet about {t}.",
    "Describe {t} to someone who has never heard of it.",
    "Write three quiz questions about {t}, with answers.", "How do scientists study {t}?",
    "What is the future of {t}?", "Write a dialogue between two friends discussing {t}.",
    "Explain {t} in one paragraph.", "What words are related to {t}?",
    "Create a short lesson plan about {t}.", "What are five key terms about {t}?",
    "Why do people find {t} fascinating?", "Give a step-by-step explanation of {t}.",
    "Write a paragraph for a children's book about {t}.",
    "What would the world be like without {t}?",
]
TRAIN_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "machine learning", "the human heart", "climate change", "the Roman Empire", "electricity",
    "gravity", "the internet", "honey bees", "the Moon", "recycling", "vaccines", "chess",
    "the Pacific Ocean", "dinosaurs", "renewable energy", "the printing press", "rainforests",
    "the immune system", "earthquakes", "Python programming", "the solar system", "coffee",
    "the Great Wall of China", "democracy", "plate tectonics", "music theory", "sleep",
    "the stock market", "bicycles", "penguins", "the periodic table", "ancient Egypt",
    "healthy eating", "photography", "the Olympic Games", "DNA", "airplanes", "deserts",
    "the Renaissance", "friendship", "time management", "the brain", "volunteering",
    "rivers", "mountains", "the Amazon", "elephants", "whales", "butterflies", "mushrooms",
    "trees", "coral reefs", "hurricanes", "tornadoes", "snow", "rainbows", "the Sun", "Mars",
    "Jupiter", "stars", "galaxies", "telescopes", "rockets", "satellites", "the speed of light",
    "magnets", "atoms", "chemistry", "algebra", "geometry", "prime numbers", "statistics",
    "probability", "calculus", "cryptography", "databases", "operating systems",
    "web browsers", "smartphones", "batteries", "electric cars", "trains", "bridges",
    "skyscrapers", "architecture", "painting", "sculpture", "poetry", "novels", "theater",
    "movies", "the piano", "the guitar", "orchestras", "dance", "cooking pasta", "baking bread",
    "chocolate", "cheese", "rice", "spices", "gardening", "composting", "bird watching",
    "hiking", "camping", "swimming", "running", "yoga", "meditation", "football", "basketball",
    "tennis", "the Middle Ages", "the Vikings", "ancient Greece", "the Aztecs",
    "the Cold War", "World War II", "the Moon landing", "the Wright brothers", "Marie Curie",
    "Isaac Newton", "Albert Einstein", "Leonardo da Vinci", "Shakespeare", "languages",
    "learning to read", "public speaking", "writing an essay", "job interviews", "budgeting",
    "saving money", "taxes", "banks", "inflation", "supply and demand", "small businesses",
    "marketing", "teamwork", "leadership", "kindness", "habits", "memory", "emotions",
    "dogs", "cats", "horses", "owls", "sharks", "frogs", "ants", "spiders", "bacteria",
    "viruses", "the skeleton", "muscles", "the lungs", "digestion", "nutrition", "water",
    "oxygen", "carbon", "plastic", "glass", "steel", "paper", "maps", "compasses", "clocks",
    "calendars", "weather forecasts", "oceans", "islands", "caves", "fossils", "gold",
]
TRAIN_TOPICS += [
    "the ocean tides", "the atmosphere", "wind turbines", "nuclear energy", "quantum physics",
    "evolution", "genetics", "cells", "the human eye", "the ear", "teeth", "the heart rate",
    "blood", "the kidneys", "the liver", "the skin", "hormones", "allergies", "fever",
    "exercise", "stretching", "posture", "hydration", "breakfast", "vegetables", "fruit",
    "bread", "soup", "pizza", "sushi", "tacos", "curry", "salad", "ice cream", "honey",
    "sugar", "salt", "olive oil", "fermentation", "yogurt", "farming", "tractors", "wheat",
    "corn", "potatoes", "tomatoes", "apples", "bananas", "oranges", "grapes", "wine making",
    "forests", "wetlands", "grasslands", "the Arctic", "Antarctica", "the Sahara",
    "the Himalayas", "the Alps", "the Nile", "the Mississippi River", "Lake Baikal",
    "Australia", "Japan", "Brazil", "Canada", "India", "Kenya", "Mexico", "Norway", "Egypt",
    "Paris", "London", "New York City", "Tokyo", "Rome", "cities", "villages", "roads",
    "traffic", "public transport", "bicycles in cities", "ships", "sailing", "airports",
    "helicopters", "drones", "robots", "artificial intelligence", "neural networks",
    "computer programming", "JavaScript", "SQL", "Linux", "cloud computing",
    "cybersecurity", "passwords", "email", "social media", "video games", "virtual reality",
    "3D printing", "semiconductors", "transistors", "the telephone", "radio", "television",
    "cameras", "microscopes", "lasers", "sound waves", "light", "color", "heat",
    "temperature", "energy", "friction", "momentum", "simple machines", "levers", "pulleys",
    "engines", "steam power", "electric motors", "circuits", "solar eclipses", "the seasons",
    "day and night", "the calendar year", "leap years", "time zones", "money", "credit cards",
    "interest rates", "investing", "insurance", "entrepreneurship", "customer service",
    "negotiation", "meetings", "remote work", "productivity", "goal setting", "motivation",
    "stress", "happiness", "gratitude", "empathy", "honesty", "courage", "patience",
    "curiosity", "creativity", "critical thinking", "debate", "philosophy", "ethics",
    "logic", "history museums", "libraries", "schools", "universities", "homework",
    "exams", "note taking", "reading books", "writing poetry", "grammar", "punctuation",
    "spelling", "learning a language", "sign language", "Spanish", "Chinese characters",
    "mythology", "fairy tales", "superheroes", "comics", "animation", "photography tips",
    "drawing", "pottery", "knitting", "woodworking", "origami", "magic tricks", "puzzles",
    "board games", "card games", "the Olympics history", "soccer", "baseball", "cycling",
    "skiing", "surfing", "rock climbing", "martial arts", "marathons", "birds", "parrots",
    "eagles", "wolves", "bears", "lions", "tigers", "giraffes", "zebras", "kangaroos",
    "koalas", "pandas", "dolphins", "sea turtles", "jellyfish", "crabs", "salmon", "bees",
    "ladybugs", "snails", "lizards", "snakes", "crocodiles", "camels", "cows", "chickens",
    "pets", "veterinarians", "doctors", "nurses", "firefighters", "teachers", "engineers",
    "scientists", "astronauts", "pilots", "farmers", "chefs", "artists", "musicians",
    "the Eiffel Tower", "the pyramids", "castles", "knights", "pirates", "explorers",
    "Christopher Columbus", "the Titanic", "the Great Depression", "the American Revolution",
    "the Declaration of Independence", "the United Nations", "elections", "laws",
    "human rights", "recycling plastic", "pollution", "air quality", "deforestation",
    "endangered species", "national parks", "zoos", "aquariums", "weather", "clouds",
    "rain", "lightning", "fog", "wind", "floods", "droughts", "wildfires", "tsunamis",
]
TRAIN_TOPICS = list(dict.fromkeys(TRAIN_TOPICS))  # one of each
HELDOUT_TEMPLATES = [
    "Can you tell me about {t}?", "I am curious about {t}. What is it?",
    "Write a brief explanation of {t} for a school report.", "What is the main idea behind {t}?",
]
HELDOUT_TOPICS = [
    "glaciers", "the Industrial Revolution", "octopuses", "solar panels", "the Silk Road",
    "earthworms", "jazz", "submarines", "the nervous system", "tea", "lighthouses", "comets",
]
# generated tasks: other answer styles (numbers, code, letters) than topic explanations
_CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "computes the factorial of n",
    "sorts a list of numbers", "counts the vowels in a string",
    "finds the largest number in a list", "merges two sorted lists",
    "checks if a word is a palindrome", "returns the first n Fibonacci numbers",
    "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "counts the words in a sentence", "computes the average of a list",
    "finds the second smallest number in a list", "checks if two words are anagrams",
    "capitalizes every word in a sentence", "computes the greatest common divisor of two numbers",
    "flattens a nested list", "counts how often each letter appears in a string",
    "returns the even numbers from a list", "checks if a year is a leap year",
    "converts a number to binary", "sums the digits of a number", "finds the median of a list",
]
_CODE_TEMPLATES = ["Write a Python function that {x}.",
                   "How do I write a JavaScript function that {x}?",
                   "Explain, with code, how to write a program that {x}."]
_WRITING = [
    "Write an email to my {a} asking for {b}.", "Write a thank-you note to my {a} for {b}.",
    "Give me a polite way to tell my {a} about {b}.",
]
_WHO = ["teacher", "boss", "neighbor", "friend", "landlord", "coach", "grandmother", "colleague"]
_WHAT = ["a day off", "help with a project", "the noise at night", "a book recommendation",
         "feedback on my work", "a birthday party", "a late payment", "a meeting next week"]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n user messages from TRAIN_TEMPLATES x TRAIN_TOPICS (seeded order); past the distinct
    pairs they repeat (their sampled continuations differ)."""
    pairs = [(a, b) for a in TRAIN_TEMPLATES for b in TRAIN_TOPICS]
    random.Random(seed).shuffle(pairs)
    return [tpl.format(t=topic) for tpl, topic in (pairs[i % len(pairs)] for i in range(n))]


def task_prompts(n: int, seed: int = 0) -> list[str]:
    """n generated tasks: arithmetic and word problems (fresh numbers each), code, letters."""
    rng = random.Random(seed + 101)
    out = []
    for _ in range(n):
        kind = rng.random()
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        if kind < 0.35:
            out.append(rng.choice([
                f"What is {a} + {b}?", f"What is {a} times {b}?", f"What is {a} minus {b}?",
                f"Solve for x: {b}x + {a} = {a + b * rng.randint(1, 20)}.",
                f"What is {b}% of {a}?", f"Is {a} a prime number?",
                f"If a train travels {a} km in {b % 9 + 1} hours, what is its average speed?",
                f"I have {a} apples and give away {min(a - 1, b)}. How many are left?",
                f"Convert {a} minutes to hours and minutes."]))
        elif kind < 0.7:
            out.append(rng.choice(_CODE_TEMPLATES).format(x=rng.choice(_CODE_TASKS)))
        else:
            out.append(rng.choice(_WRITING).format(a=rng.choice(_WHO), b=rng.choice(_WHAT)))
    return out


def corpus_prompts(n: int, seed: int = 0, task_fraction: float = 0.15) -> list[str]:
    """The training mixture: topic prompts with a share of generated tasks, interleaved."""
    n_tasks = int(round(n * task_fraction))
    topics, tasks = training_prompts(n - n_tasks, seed), task_prompts(n_tasks, seed)
    out, ti = [], 0
    for i in range(n):  # spread the tasks evenly, so a cut by the time budget keeps the mix
        if ti < n_tasks and (i + 1) * n_tasks >= (ti + 1) * n:
            out.append(tasks[ti])
            ti += 1
        else:
            out.append(topics[i - ti])
    return out


def temperature_for(i: int, num_distinct: int) -> float:
    """First pass over the distinct prompts: mostly greedy (3 of 4: greedy text is what
    verification accepts), some sampled at 0.8; repeats are sampled (a greedy repeat adds
    nothing)."""
    if i < num_distinct:
        return 0.8 if i % 4 == 3 else 0.0
    return 0.6 if i % 2 == 0 else 0.9


def heldout_prompts(n: int) -> list[str]:
    """User messages from templates and topics that training never sees."""
    pairs = [(a, b) for b in HELDOUT_TOPICS for a in HELDOUT_TEMPLATES]
    random.Random(1234).shuffle(pairs)
    return [tpl.format(t=topic) for tpl, topic in pairs[:n]]


def chat_text(tokenizer, message: str) -> str:
    if tokenizer is None:
        raise ValueError("model: train-mtp needs a model with a tokenizer and chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                         add_generation_prompt=True)


def chat(tokenizer, message: str) -> list[int]:
    return tokenizer.encode(chat_text(tokenizer, message))


class ChatPrompts:
    """The chat-templated token ids of `messages`, made when first asked for (a CUDA run
    lists far more prompts than its time budget reaches). The template is rendered once
    around a placeholder and the message spliced in (jinja costs ~3 ms a render, encoding
    0.1 ms); checked against full renders of the first messages, else every one is rendered."""

    _PLACEHOLDER = "\u2063pdserve-train-mtp\u2063"

    def __init__(self, tokenizer, messages: list[str]) -> None:
        self.tokenizer, self.messages = tokenizer, messages
        self._ids: dict[int, list[int]] = {}
        parts = chat_text(tokenizer, self._PLACEHOLDER).split(self._PLACEHOLDER)
        self._affix = (parts[0], parts[1]) if len(parts) == 2 else None
        if self._affix is not None and any(
                self._splice(m) != chat(tokenizer, m) for m in messages[:8]):
            self._affix = None

    def _splice(self, message: str) -> list[int]:
        pre, post = self._affix
        return self.tokenizer.encode(pre + message + post)

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, i: int) -> list[int]:
        if i not in self._ids:
            m = self.messages[i]
            self._ids[i] = self._splice(m) if self._affix else chat(self.tokenizer, m)
        return self._ids[i]
