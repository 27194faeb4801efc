"""A generated English->German corpus of quantities, prices and dates.

The main job needs parallel text that downloads nothing and ships no
third-party sentences, yet asks a translation model for real work: German
numbers put the units before the tens ("twenty-one" -> "einundzwanzig"), dates
change form ("on the third of May" -> "am dritten Mai"), verbs move to the end
("she was born on ..." -> "sie wurde am ... geboren"), and nouns carry gender.

Each side comes in two forms: ``text`` (what a person writes, used as the
sacreBLEU reference) and ``tokens``, split into words and number morphemes with
subword-nmt's ``@@`` continuation marker ("ein@@ und@@ zwanzig"), so that
``fairseq-generate --post-process subword_nmt`` turns tokens back into text.
"""

import random
from typing import Iterator, List, NamedTuple, Tuple

EN_UNITS = ["", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
EN_TEENS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
DE_UNITS = ["", "ein", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"]
DE_TEENS = ["zehn", "elf", "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
EN_ORDINAL = {1: "first", 2: "second", 3: "third", 5: "fifth", 8: "eighth", 9: "ninth", 12: "twelfth"}
DE_ORDINAL_STEM = {1: "ers", 3: "drit", 7: "sieb", 8: "ach"}
MONTHS = [("January", "Januar"), ("February", "Februar"), ("March", "März"), ("April", "April"),
          ("May", "Mai"), ("June", "Juni"), ("July", "Juli"), ("August", "August"),
          ("September", "September"), ("October", "Oktober"), ("November", "November"), ("December", "Dezember")]
# (English singular, English plural, German singular, German plural, German gender)
NOUNS = [("apple", "apples", "Apfel", "Äpfel", "m"), ("book", "books", "Buch", "Bücher", "n"),
         ("chair", "chairs", "Stuhl", "Stühle", "m"), ("lamp", "lamps", "Lampe", "Lampen", "f"),
         ("car", "cars", "Auto", "Autos", "n"), ("bottle", "bottles", "Flasche", "Flaschen", "f"),
         ("house", "houses", "Haus", "Häuser", "n"), ("table", "tables", "Tisch", "Tische", "m"),
         ("bicycle", "bicycles", "Fahrrad", "Fahrräder", "n"), ("cup", "cups", "Tasse", "Tassen", "f"),
         ("ticket", "tickets", "Fahrkarte", "Fahrkarten", "f"), ("coat", "coats", "Mantel", "Mäntel", "m")]
ADJECTIVES = [("red", "rot"), ("green", "grün"), ("old", "alt"), ("new", "neu"), ("small", "klein"),
              ("large", "groß"), ("cheap", "billig"), ("blue", "blau")]
DE_ARTICLE = {"m": "der", "f": "die", "n": "das"}
SUBJECTS = [("I", "ich", "habe"), ("we", "wir", "haben"), ("they", "sie", "haben")]


class Pair(NamedTuple):
    """One sentence pair: tokenised source/target (``@@`` marks a split word) and their plain text."""

    src_tokens: str
    tgt_tokens: str
    src_text: str
    tgt_text: str


def join_tokens(tokens: str) -> str:
    """Undo the ``@@`` splits, as ``fairseq-generate --post-process subword_nmt`` does."""
    return (tokens + " ").replace("@@ ", "").rstrip()


def _word(*morphemes: str) -> List[str]:
    """One written word made of morphemes, as tokens: ["ein@@", "und@@", "zwanzig"]."""
    parts = [m for m in morphemes if m]
    return [p + "@@" for p in parts[:-1]] + parts[-1:]


def _en_below_100(n: int) -> List[str]:
    if n < 10:
        return [EN_UNITS[n]]
    if n < 20:
        return [EN_TEENS[n - 10]]
    return [EN_TENS[n // 10]] if n % 10 == 0 else [EN_TENS[n // 10] + "@@", "-@@", EN_UNITS[n % 10]]


def en_number(n: int) -> List[str]:
    """1..999 in English words, as tokens ("three hundred and twenty@@ -@@ one")."""
    hundreds, rest = divmod(n, 100)
    tokens = [EN_UNITS[hundreds], "hundred"] if hundreds else []
    if hundreds and rest:
        tokens.append("and")
    return tokens + (_en_below_100(rest) if rest else [])


def _de_morphemes(n: int) -> List[str]:
    hundreds, rest = divmod(n, 100)
    parts = [DE_UNITS[hundreds], "hundert"] if hundreds else []
    if rest == 1:
        parts.append("eins")
    elif rest < 10:
        parts.append(DE_UNITS[rest])
    elif rest < 20:
        parts.append(DE_TEENS[rest - 10])
    elif rest % 10:
        parts += [DE_UNITS[rest % 10], "und", DE_TENS[rest // 10]]
    else:
        parts.append(DE_TENS[rest // 10])
    return [p for p in parts if p]


def de_number(n: int) -> List[str]:
    """1..999 as one German word split into morphemes ("drei@@ hundert@@ ein@@ und@@ zwanzig")."""
    return _word(*_de_morphemes(n))


def en_year(year: int) -> List[str]:
    century, rest = divmod(year, 100)
    if century == 20:
        return ["two", "thousand"] + (["and"] + _en_below_100(rest) if rest else [])
    tokens = _en_below_100(century)
    if rest == 0:
        return tokens + ["hundred"]
    return tokens + (["oh", EN_UNITS[rest]] if rest < 10 else _en_below_100(rest))


def de_year(year: int) -> List[str]:
    century, rest = divmod(year, 100)
    head = ["zwei", "tausend"] if century == 20 else [DE_TEENS[century - 10], "hundert"]
    return _word(*head, *(_de_morphemes(rest) if rest else []))


def en_ordinal(day: int) -> List[str]:
    if day in EN_ORDINAL:
        return [EN_ORDINAL[day]]
    if day < 20:
        word = _en_below_100(day)[0]
        return [(word[:-1] if word.endswith("e") else word) + "th"]
    tens, unit = divmod(day, 10)
    if unit == 0:
        return [EN_TENS[tens][:-1] + "ieth"]
    return [EN_TENS[tens] + "@@", "-@@"] + en_ordinal(unit)


def de_ordinal(day: int) -> List[str]:
    """Dative ordinal after "am": "dritten", "ein@@ und@@ zwanzig@@ sten"."""
    if day < 20:
        stem = DE_ORDINAL_STEM.get(day) or _de_morphemes(day)[0].replace("eins", "ein")
        return _word(stem, "ten")
    return _word(*_de_morphemes(day), "sten")


def _capitalised(tokens: List[str]) -> List[str]:
    return [tokens[0][:1].upper() + tokens[0][1:]] + tokens[1:]


def _sentence(rng: random.Random) -> Tuple[List[str], List[str]]:
    kind = rng.randrange(4)
    noun = rng.choice(NOUNS)
    en_adj, de_adj = rng.choice(ADJECTIVES)
    count = rng.randint(2, 999)
    if kind == 0:
        en_subj, de_subj, de_verb = rng.choice(SUBJECTS)
        en = [en_subj, "bought"] + en_number(count) + [en_adj, noun[1]]
        de = [de_subj, de_verb] + de_number(count) + [de_adj + "e", noun[3], "gekauft"]
    elif kind == 1:
        en = ["the", en_adj, noun[0], "costs"] + en_number(count) + ["euros"]
        de = [DE_ARTICLE[noun[4]], de_adj + "e", noun[2], "kostet"] + de_number(count) + ["Euro"]
    else:
        day = rng.randint(1, 31)
        en_month, de_month = rng.choice(MONTHS)
        year = rng.randint(1900, 2099)
        if kind == 2:
            en = ["she", "was", "born", "on", "the"] + en_ordinal(day) + ["of", en_month] + en_year(year)
            de = ["sie", "wurde", "am"] + de_ordinal(day) + [de_month] + de_year(year) + ["geboren"]
        else:
            en = ["we", "sold"] + en_number(count) + [noun[1], "on", "the"] + en_ordinal(day) + ["of", en_month]
            de = ["wir", "haben", "am"] + de_ordinal(day) + [de_month] + de_number(count) + [noun[3], "verkauft"]
    return _capitalised(en) + ["."], _capitalised(de) + ["."]


def _attach_full_stop(tokens: List[str]) -> str:
    tokens = tokens[:-2] + [tokens[-2] + "@@", tokens[-1]]
    return " ".join(tokens)


def generate_pairs(count: int, seed: int) -> Iterator[Pair]:
    """``count`` sentence pairs drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    for _ in range(count):
        en, de = _sentence(rng)
        src, tgt = _attach_full_stop(en), _attach_full_stop(de)
        yield Pair(src, tgt, join_tokens(src), join_tokens(tgt))


def generate_splits(sizes: dict, seed: int = 1) -> dict:
    """Disjoint splits, e.g. ``{"train": 30000, "valid": 300, "test": 500}``: no source sentence
    of a later split occurs in an earlier one."""
    seen = set()
    splits = {}
    stream = generate_pairs(10 * sum(sizes.values()) + 1000, seed)
    for name, size in sizes.items():
        pairs = []
        for pair in stream:
            if pair.src_text not in seen:
                seen.add(pair.src_text)
                pairs.append(pair)
                if len(pairs) == size:
                    break
        if len(pairs) < size:
            raise ValueError(f"could not draw {size} distinct pairs for {name}")
        splits[name] = pairs
    return splits
