"""RULER-style long-context tasks with exact token counts, written for this project.

``make_sample(task, length, depth, seed, encode)`` returns a prompt of exactly ``length`` tokens
(instruction + haystack with needles + question) and the answer tokens that follow it. Tasks:

- ``needle_single``: one pass key (7 digits) in the haystack;
- ``needle_multikey``: four "magic number for <key>" needles, one asked for, three distractors;
- ``needle_multivalue``: four numbers for the same key, all asked for (in order of appearance);
- ``variable_tracking``: a chain ``VAR A = 12345; VAR B = VAR A; ...``, all names asked for;
- ``qa``: a SQuAD or HotpotQA question, its gold paragraph(s) among distractor paragraphs;
- ``needle_multiquery``: four "magic number for <key>" needles, each asked for in turn after the
  prompt: the answer tokens of all four are scored (``answer_mask``), so one sample carries four
  retrievals and its answer NLL spreads less than one question's.

``make_text_window(source, length, seed, encode)``: a window of natural text (``code``: the
Python standard library's sources; ``prose``: Shakespeare's plays) with no question, for loss
measurements on text as it is.

The haystack is RULER's Paul Graham essays (or Shakespeare) for the needle tasks and other
questions' paragraphs for ``qa``. The asked-for needle (the first of a chain) sits at ``depth``
(0 = right after the instruction, 1 = right before the question), snapped to a sentence
boundary; other needles go to seeded random depths. Pieces are tokenized separately and
concatenated as ids, so counts are exact. Where the tokenizer puts a lone space token before
the answer (digit-splitting tokenizers do), that token ends the prompt (``_leading_space_token``). ``encode`` is any ``str -> list[int]`` (the model's own
tokenizer in the eval, a toy one in tests). Pure Python; must not import torch or megatron.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Sequence, Tuple

from . import assets

TASKS = ("needle_single", "needle_multikey", "needle_multivalue", "variable_tracking", "qa",
         "needle_multiquery")
TEXT_SOURCES = ("code", "prose")
Encode = Callable[[str], List[int]]

_WORDS = ("amber", "brisk", "cobalt", "dusty", "eager", "fabled", "gentle", "hollow", "icy",
          "jolly", "keen", "lunar", "mellow", "noble", "opal", "placid", "quiet", "rustic",
          "silent", "tidal", "umber", "vivid", "wary", "zesty")
_NOUNS = ("anchor", "badger", "canyon", "dragon", "ember", "falcon", "garden", "harbor",
          "island", "jungle", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
          "quarry", "river", "saddle", "timber", "valley", "walnut", "yarrow", "zephyr")

_NIAH_PREFIX = ("Some special magic numbers are hidden within the following text. Make sure to "
                "memorize it. I will quiz you about the numbers afterwards.\n")
_PASSKEY_PREFIX = ("There is an important piece of information hidden inside a lot of irrelevant "
                   "text. Find it and memorize it. I will quiz you about it afterwards.\n")
_VT_PREFIX = "Memorize and track the chain of variable assignments hidden in the following text.\n"
_QA_INSTR = ("Answer the question based on the given documents. Only give me the answer and do "
             "not output any other words.")


class TaskLengthError(ValueError):
    """The requested length cannot hold the instruction, needles and question."""


@dataclass
class TaskSample:
    """One prompt of exactly ``length`` tokens and the answer tokens that follow it."""

    task: str
    length: int
    depth: float
    seed: int
    input_ids: List[int]                 # the prompt, len == length
    answer_ids: List[int]                # gold continuation (teacher forcing target)
    answers: Tuple[str, ...]             # gold strings (all must appear, except qa: any)
    needle_spans: List[Tuple[int, int]] = field(default_factory=list)  # [start, end) in prompt
    answer_mask: List[bool] = field(default_factory=list)  # per answer id: scored (empty: all)

    def scored(self) -> List[bool]:
        """Per answer id, whether it is an answer token (later questions are not)."""
        return list(self.answer_mask) or [True] * len(self.answer_ids)


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.choice(_NOUNS)}"


def _var(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _check_args(task: str, length: int, depth: float) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {TASKS}")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length={length!r}: expected a positive token count")
    if not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r}: expected a number in [0, 1]")


def _filler_units(units: Sequence[str], rng: random.Random, sep: str) -> Iterator[str]:
    """Units (sentences / paragraphs) in order from a seeded start, wrapping around."""
    start = rng.randrange(len(units))
    i = start
    while True:
        yield sep + units[i]
        i = (i + 1) % len(units)


def _assemble(encode: Encode, length: int, prefix: str, needles: List[Tuple[float, str]],
              question: str, filler: Iterator[str], task: str, suffix_ids: List[int] = ()):
    """prefix + filler with needles at depths + question (+ suffix ids), ``length`` tokens."""
    prefix_ids, question_ids = encode(prefix), encode(question) + list(suffix_ids)
    needle_ids = [(d, encode(t)) for d, t in needles]
    fixed = len(prefix_ids) + len(question_ids) + sum(len(ids) for _, ids in needle_ids)
    fill = length - fixed
    if fill < 0:
        raise TaskLengthError(
            f"length={length} is too short for task {task!r}: the instruction, needle(s) and "
            f"question alone take {fixed} tokens; expected length >= {fixed}")
    hay: List[int] = []
    bounds = [0]                      # sentence boundaries inside the filler
    while len(hay) < fill:
        hay.extend(encode(next(filler)))
        bounds.append(min(len(hay), fill))
    hay = hay[:fill]
    # needles at the boundary nearest to depth * fill; stable for equal depths
    placed = sorted(((min(bounds, key=lambda b: (abs(b - d * fill), b)), k, ids)
                     for k, (d, ids) in enumerate(needle_ids)), key=lambda x: (x[0], x[1]))
    out, spans, cursor = list(prefix_ids), [None] * len(needle_ids), 0
    for pos, k, ids in placed:
        out.extend(hay[cursor:pos])
        cursor = pos
        spans[k] = (len(out), len(out) + len(ids))
        out.extend(ids)
    out.extend(hay[cursor:])
    out.extend(question_ids)
    assert len(out) == length, (len(out), length)
    return out, spans


def _other_depths(rng: random.Random, n: int) -> List[float]:
    return [rng.random() for _ in range(n)]


def make_sample(task: str, length: int, depth: float, seed: int, encode: Encode, *,
                haystack: str = "essays", num_needles: int = 4, num_hops: int = 4) -> TaskSample:
    """One seeded sample; see the module docstring for the tasks."""
    _check_args(task, length, depth)
    rng = random.Random(f"{task}:{length}:{depth}:{seed}")
    if task == "qa":
        return _make_qa(length, depth, seed, rng, encode)
    filler = _filler_units(assets.haystack_sentences(haystack), rng, " ")
    if task == "needle_multiquery":
        return _make_multiquery(length, depth, seed, rng, encode, filler, num_needles)
    if task == "needle_single":
        key = _number(rng, 7)
        needles = [(depth, f" The pass key is {key}. Remember it. {key} is the pass key.")]
        question = "\nWhat is the pass key? The pass key is"
        answers, answer, prefix = (key,), " " + key, _PASSKEY_PREFIX
    elif task == "needle_multikey":
        keys, values, needles = _keyed_needles(rng, num_needles, depth)
        question = (f"\nWhat is the special magic number for {keys[0]} mentioned in the provided "
                    f"text? The special magic number for {keys[0]} mentioned in the provided "
                    f"text is")
        answers, answer, prefix = (values[0],), " " + values[0], _NIAH_PREFIX
    elif task == "needle_multivalue":
        key = _key(rng)
        values = [_number(rng, 7) for _ in range(num_needles)]
        depths = [depth] + _other_depths(rng, num_needles - 1)
        needles = [(d, f" One of the special magic numbers for {key} is: {v}.")
                   for d, v in zip(depths, values)]
        question = (f"\nWhat are all the special magic numbers for {key} mentioned in the "
                    f"provided text? The special magic numbers for {key} mentioned in the "
                    f"provided text are")
        answers, answer, prefix = tuple(values), None, _NIAH_PREFIX  # ordered after placement
    else:  # variable_tracking
        names = []
        while len(names) < num_hops + 1:
            n = _var(rng)
            if n not in names:
                names.append(n)
        value = _number(rng, 5)
        depths = sorted([depth] + [depth + (1 - depth) * r for r in _other_depths(rng, num_hops)])
        chain = [f" VAR {names[0]} = {value}."] + [
            f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, num_hops + 1)]
        needles = list(zip(depths, chain))
        question = (f"\nQuestion: Find all variables that are assigned the value {value} in the "
                    f"text above. Answer: According to the chain of variable assignments in the "
                    f"text above, {num_hops + 1} variables are assigned the value {value}, they "
                    f"are:")
        answers, answer, prefix = tuple(names), " " + " ".join(names), _VT_PREFIX
    lead = _leading_space_token(encode, answers[0])
    ids, spans = _assemble(encode, length, prefix, needles, question, filler, task, lead)
    if answer is None:  # multivalue: values in their order of appearance in the prompt
        answers = tuple(v for _, v in sorted(zip(spans, values)))
        answer = " " + ", ".join(answers)
    answer_ids = encode(answer)[len(lead):]
    return TaskSample(task, length, float(depth), seed, ids, answer_ids, answers, spans)


def _keyed_needles(rng: random.Random, num_needles: int, depth: float) -> tuple:
    """``num_needles`` distinct keys, a 7-digit number each, and their needle sentences (the
    first at ``depth``, the others at random depths): (keys, values, needles)."""
    keys: List[str] = []
    while len(keys) < num_needles:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    values = [_number(rng, 7) for _ in keys]
    depths = [depth] + _other_depths(rng, num_needles - 1)
    needles = [(d, f" One of the special magic numbers for {k} is: {v}.")
               for d, k, v in zip(depths, keys, values)]
    return keys, values, needles


def _make_multiquery(length: int, depth: float, seed: int, rng: random.Random, encode: Encode,
                     filler, num_needles: int) -> TaskSample:
    """``num_needles`` keyed numbers, each asked for in turn (the one at ``depth`` first): the
    prompt ends with the first question, ``answer_ids`` hold its answer, then each next
    question and its answer, the questions' tokens masked out of the score."""
    keys, values, needles = _keyed_needles(rng, num_needles, depth)

    def question(k):
        return f"\nWhat is the special magic number for {k}? The special magic number for {k} is"

    lead = _leading_space_token(encode, values[0])
    ids, spans = _assemble(encode, length, _NIAH_PREFIX, needles, question(keys[0]), filler,
                           "needle_multiquery", lead)
    answer_ids: List[int] = []
    mask: List[bool] = []
    for i, (k, v) in enumerate(zip(keys, values)):
        if i:
            q = encode(question(k)) + lead
            answer_ids += q
            mask += [False] * len(q)
        a = encode(" " + v)[len(lead):]
        answer_ids += a
        mask += [True] * len(a)
    return TaskSample("needle_multiquery", length, float(depth), seed, ids, answer_ids,
                      tuple(values), spans, mask)


def make_text_window(source: str, length: int, seed: int, encode: Encode) -> TaskSample:
    """``length`` tokens of natural text from a seeded place (``TEXT_SOURCES``): ``code`` the
    standard library's Python sources, ``prose`` Shakespeare's plays, files read in order from a
    seeded first one. No question: ``answer_ids`` is empty (the loss is the text's own)."""
    if source not in TEXT_SOURCES:
        raise ValueError(f"source={source!r}: expected one of {TEXT_SOURCES}")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length={length!r}: expected a positive token count")
    rng = random.Random(f"text:{source}:{length}:{seed}")
    paths = assets.text_files(source)
    i = rng.randrange(len(paths))
    ids: List[int] = []
    for _ in range(len(paths)):
        with open(paths[i], encoding="utf-8", errors="replace") as f:
            text = f.read()
        if not ids:                          # a seeded start inside the first file, at a line
            lines = text.splitlines(keepends=True)
            text = "".join(lines[rng.randrange(max(len(lines) // 2, 1)):])
        ids += encode(text)
        if len(ids) >= length:
            break
        i = (i + 1) % len(paths)
    if len(ids) < length:
        raise TaskLengthError(f"length={length}: the {source} texts hold only {len(ids)} tokens")
    return TaskSample(f"text_{source}", length, 0.0, seed, ids[:length], [], ())


def _leading_space_token(encode: Encode, answer: str) -> List[int]:
    """The separate space token a tokenizer puts before the answer, if it has one.

    Tokenizers that split digits (SmolLM2's, Qwen's) encode " 2333853" as [" ", "2", ...]: the
    lone space then ends the prompt, so that scoring is about the answer's content tokens, not
    about whether the model emits a lone space or a space-prefixed word first.
    """
    space, full, bare = encode(" "), encode(" " + answer), encode(answer)
    return space if len(space) == 1 and full == space + bare else []


def _make_qa(length: int, depth: float, seed: int, rng: random.Random, encode: Encode):
    """SQuAD (even seeds) or HotpotQA (odd seeds); distractors are other items' paragraphs.

    Questions with short answers (<= 5 words, not yes/no) whose gold paragraphs fit in half the
    length are drawn; the rest of the length is other questions' paragraphs.
    """
    hotpot = seed % 2 == 1
    items = assets.hotpotqa_items() if hotpot else assets.squad_items()
    for _ in range(500):
        item = items[rng.randrange(len(items))]
        q, ans = item[0], item[1]
        gold = list(item[2]) if hotpot else [item[2]]
        if not gold or len(ans[0].split()) > 5 or ans[0].lower() in ("yes", "no"):
            continue
        needles = [(depth, "\nPassage: " + g + "\n") for g in gold]
        if sum(len(encode(t)) for _, t in needles) <= length // 2:
            break
    else:
        raise TaskLengthError(f"length={length} is too short for task 'qa': no question's gold "
                              f"paragraphs fit in half of it; expected a longer length")
    pool = []
    while len(pool) < 200:
        other = items[rng.randrange(len(items))]
        pool.extend(p for p in (other[3] if hotpot else [other[2]]) if p not in gold)
    filler = _filler_units(pool, rng, "\nPassage: ")
    question = f"\n{_QA_INSTR}\n\nQuestion: {q} Answer:"
    lead = _leading_space_token(encode, ans[0])
    ids, spans = _assemble(encode, length, _QA_INSTR + "\n\nThe following are given documents.\n",
                           needles, question, filler, "qa", lead)
    return TaskSample("qa", length, float(depth), seed, ids, encode(" " + ans[0])[len(lead):],
                      ans, spans)


def make_suite(tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
               samples: int, encode: Encode, seed: int = 0, **kw) -> List[TaskSample]:
    """Every (task, length, depth) with ``samples`` seeds each (seeds seed .. seed+samples-1)."""
    return [make_sample(t, n, d, seed + s, encode, **kw)
            for t in tasks for n in lengths for d in depths for s in range(samples)]
