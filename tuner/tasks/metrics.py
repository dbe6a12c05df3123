"""Task quality metrics, with well-kept libraries where they exist.

  * GSM8K: exact match of the final number (``#### N`` preferred, then "the answer is N", then the
    last number in the text), compared numerically;
  * CNN/DM: ROUGE-1/2/L F1 (``rouge-score``, stemming on), mean over items;
  * WMT16: corpus BLEU (``sacrebleu``);
  * HumanEval / MBPP: pass@1, the generated program run against the tests in the sandbox.
"""

from __future__ import annotations

import re
from typing import Sequence

from tuner.tasks.sandbox import Limits, run_program

_NUMBER = r"-?[\d,]*\.?\d+"


def _to_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_gsm8k_answer(text: str) -> float | None:
    """The final numeric answer of a GSM8K completion, or None."""
    for pattern in (rf"####\s*\$?\s*({_NUMBER})", rf"answer is[:\s]*\$?\s*({_NUMBER})"):
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return _to_number(found[-1])
    numbers = re.findall(_NUMBER, text)
    return _to_number(numbers[-1]) if numbers else None


def gsm8k_correct(completion: str, reference_answer: str) -> bool:
    predicted = extract_gsm8k_answer(completion)
    expected = extract_gsm8k_answer(reference_answer)
    return predicted is not None and expected is not None and abs(predicted - expected) < 1e-6


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def rouge(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for hyp, ref in zip(hypotheses, references):
        for key, score in scorer.score(ref, hyp).items():
            totals[key] += score.fmeasure
    return {key: value / max(1, len(hypotheses)) for key, value in totals.items()}


def extract_code(completion: str) -> str:
    """The first fenced code block of a chat answer, or the completion itself."""
    block = re.search(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", completion, flags=re.DOTALL)
    return block.group(1) if block else completion


def humaneval_program(item: dict, completion: str) -> str:
    """Prompt + completion (or the model's whole function) + the task's tests."""
    code = extract_code(completion)
    if re.search(rf"def\s+{re.escape(item['entry_point'])}\s*\(", code):
        body = item["prompt"] + "\n" + code            # the model wrote the whole function
    else:
        body = item["prompt"] + code                   # a continuation of the prompt's body
    return f"{body}\n\n{item['test']}\n\ncheck({item['entry_point']})\n"


def mbpp_program(item: dict, completion: str) -> str:
    tests = "\n".join(item["test_list"])
    return f"{item.get('test_setup_code', '')}\n{extract_code(completion)}\n\n{tests}\n"


def passes(program: str, limits: Limits = Limits()) -> bool:
    return run_program(program, limits).passed
