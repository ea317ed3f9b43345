"Tests of jetrl.tasks: seeded generators, exact rewards, the safe Countdown verifier, GSM8K files, RewardSet."
import json
import math
import warnings
from fractions import Fraction

import pytest

from jetrl.tasks import (
    MAX_COMPLETION_CHARS, MAX_DIGITS, ArithmeticChainTask, ArithmeticTask, CountdownTask, ExpressionError, GSM8KTask, RewardFunctionWarning,
    TASKS, chain_steps_reward, combine_rewards, countdown_reward, countdown_score, evaluate_expression,
    extract_answer, extract_reference_answer, format_reward, get_task, make_prompt, number_reward, parse_number,
    read_gsm8k, to_chat)


def columns_of(rows: list[dict], *names: str) -> dict[str, list]:
    "The named columns of `rows` as lists, the way TRL passes them to reward functions."
    return {name: [row[name] for row in rows] for name in names}


def tagged(answer: str) -> str:
    return f"<answer>{answer}</answer>"


# --- determinism -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task_class, knobs", [(ArithmeticTask, {"digits": 3, "operands": 4}),
                                               (ArithmeticChainTask, {"steps": 5}),
                                               (CountdownTask, {"count": 4})])
def test_same_seed_same_rows_other_seed_other_rows(task_class, knobs):
    rows = task_class(seed=7, **knobs).sample(20)
    assert rows == task_class(seed=7, **knobs).sample(20)
    assert rows[:5] == task_class(seed=7, **knobs).sample(5)
    assert rows != task_class(seed=8, **knobs).sample(20)
    assert len({row["prompt"] for row in rows}) > 1
    assert all({"prompt", "answer", "answer_format"} <= set(row) for row in rows)


def test_prompt_format_is_short_and_documented():
    assert make_prompt("What is 47 + 38?") == "What is 47 + 38? Put the final answer in <answer></answer>.\nAnswer:"
    row = ArithmeticTask(seed=0).sample(1)[0]
    assert row["prompt"].startswith("What is ") and row["prompt"].endswith("\nAnswer:")


# --- arithmetic ----------------------------------------------------------------------------------------------------

def test_arithmetic_answers_match_python_precedence():
    rows = ArithmeticTask(digits=2, operands=5, seed=3).sample(100)
    for row in rows:
        assert Fraction(row["answer"]) == evaluate_expression(row["expression"])[0]
        digits = [part for part in row["expression"].split() if part.isdigit()]
        assert len(digits) == 5 and all(len(number) == 2 for number in digits)


def test_arithmetic_correct_scores_one_wrong_zero():
    rows = ArithmeticTask(digits=3, operands=3, seed=1).sample(10)
    right = [tagged(row["answer"]) for row in rows]
    wrong = [tagged(str(int(row["answer"]) + 1)) for row in rows]
    columns = columns_of(rows, "answer", "answer_format")
    assert number_reward(None, right, **columns) == [1.0] * 10
    assert number_reward(None, wrong, **columns) == [0.0] * 10
    assert number_reward(None, [row["answer"] for row in rows], **columns) == [0.0] * 10  # untagged


def test_last_number_format():
    rows = ArithmeticTask(seed=2, answer_format="last_number").sample(3)
    completions = [f"Adding up gives {row['answer']}." for row in rows]
    assert number_reward(None, completions, **columns_of(rows, "answer", "answer_format")) == [1.0] * 3
    assert format_reward(None, completions, **columns_of(rows, "answer_format")) == [1.0] * 3


def test_long_answer_variants_are_long():
    product = ArithmeticTask(digits=20, operands=2, operators="*", seed=0).sample(1)[0]
    assert len(product["answer"]) >= 39
    chain = ArithmeticChainTask(steps=30, seed=0).sample(1)[0]
    assert len(chain["intermediate"]) == 30 and chain["answer"] == chain["intermediate"][-1]


def test_chain_rewards_final_answer_and_steps_in_order():
    task = ArithmeticChainTask(steps=4, seed=5)
    row = task.sample(1)[0]
    steps = row["intermediate"]
    completions = ["\n".join(steps) + "\n" + tagged(row["answer"]),
                   "\n".join(steps[:2]) + "\n" + tagged("0"),
                   "\n".join(reversed(steps))]
    scores = task.rewards().score(None, completions, **columns_of([row] * 3, "answer", "answer_format", "intermediate"))
    assert scores.per_function["number_reward"] == [1.0, 0.0, 0.0]
    assert scores.per_function["chain_steps_reward"][:2] == [1.0, 0.5]
    assert chain_steps_reward(None, ["3 2 1"], intermediate=[["1", "2", "3"]]) == [1 / 3]


# --- countdown -----------------------------------------------------------------------------------------------------

def test_countdown_generated_solutions_verify():
    task = CountdownTask(count=5, max_number=50, max_target=500, seed=11)
    rows = task.sample(100)
    assert all(1 <= row["target"] <= 500 and len(row["numbers"]) == 5 for row in rows)
    scores = countdown_reward(None, [tagged(row["answer"]) for row in rows],
                              **columns_of(rows, "numbers", "target", "answer_format"))
    assert scores == [1.0] * 100


NUMBERS, TARGET = [3, 7, 25, 50], 200


@pytest.mark.parametrize("expression", ["(3 + 7) * 25 - 50", "50 * (7 - 3)", "(3 + 7) * 25 - 50 = 200",
                                        "-(-(3 + 7) * 25 + 50)"])
def test_countdown_accepts_correct(expression):
    assert countdown_score(expression, NUMBERS, TARGET) == 1.0


@pytest.mark.parametrize("expression", [
    "__import__('os')", "__import__('os').system('true')", "2**99999999", "9**9**9", "200 + 2**3", "1/0",
    "200 + 3 / (7 - 7)", "200 + 50 / (1 - 1)", "x", "TARGET", "abs(-200)", "(200).real", "lambda: 200",
    "200 + 0", "8 * 25", "50 * 4", "50 * (7 - 3) + 3 - 3 + 0", "50 + 50 + 50 + 50", "25 * 8 * (3 - 3 + 1)",
    "(3 + 7) * 25", "2.0 * 100", "200", "", "   ", ")(", "(3 + 7) * 25 - 50 +", "7" * 100_000,
    "(" * 500 + "200" + ")" * 500, "3" + " + 3" * 5_000, "99999999 * 99999999 * 0 + 200", "\x00", "200 % 7",
])
def test_countdown_rejects_malformed_and_adversarial(expression):
    assert countdown_score(expression, NUMBERS, TARGET) == 0.0
    assert countdown_reward(None, [tagged(expression)], numbers=[NUMBERS], target=[TARGET]) == [0.0]


def test_countdown_number_given_twice_may_be_used_twice():
    assert countdown_score("50 + 50", [50, 50, 1], 100) == 1.0
    assert countdown_score("50 + 50", [50, 1, 2], 100) == 0.0


def test_countdown_reward_without_answer_or_with_huge_completion():
    answer = tagged("(3 + 7) * 25 - 50")
    at_the_bound = "x" * (MAX_COMPLETION_CHARS - len(answer)) + answer          # read: it is within the bound
    past_the_bound = "x" + at_the_bound                                          # scores 0 unread
    completions = ["no answer here", "<answer>" * 20_000, at_the_bound, past_the_bound]
    assert countdown_reward(None, completions, numbers=[NUMBERS] * 4, target=[TARGET] * 4) == [0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("text", ["2**10", "9**9**9", "__import__('os')", "1/0", "1 + x", "10**13 + 1"])
def test_evaluator_raises_only_expression_error(text):
    with pytest.raises(ExpressionError):
        evaluate_expression(text)


# --- GSM8K ---------------------------------------------------------------------------------------------------------

def write_jsonl(path, examples) -> None:
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))


GSM8K_EXAMPLES = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48 / 2 = <<48/2=24>>24 clips.\nIn all 48 + 24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A house costs $1,200 plus $34. What is the total?", "answer": "1,200 + 34 = 1,234\n#### 1,234"},
    {"question": "It is 5 degrees and drops by 17. What is it now?", "answer": "5 - 17 = -12\n#### -12"},
    {"question": "Half of 7?", "answer": "7 / 2 = 3.5\n#### 3.5"},
]


def test_gsm8k_reference_extraction(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    write_jsonl(path, GSM8K_EXAMPLES)
    assert [example["answer"] for example in read_gsm8k(path)] == ["72", "1234", "-12", "3.5"]
    assert extract_reference_answer("work\n####   $2,000,000 ") == "2000000"


def test_gsm8k_task_rows_and_rewards(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    write_jsonl(path, GSM8K_EXAMPLES * 5)  # 20 rows, so two shuffles differ
    rows = GSM8KTask(path, seed=0).sample(20)
    assert rows == get_task("gsm8k", path=str(path), seed=0).sample(20)
    assert rows != GSM8KTask(path, seed=1).sample(20)
    assert [row["answer"] for row in GSM8KTask(path, shuffle=False).sample(4)] == ["72", "1234", "-12", "3.5"]
    completions = ["So the total is <answer>1,234</answer>", "<answer>-12</answer>", "<answer>3.50</answer>",
                   "<answer>12</answer>", "the answer is 72"]
    answers = ["1234", "-12", "3.5", "-12", "72"]
    assert number_reward(None, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0]
    last_number = ["It costs $1,234.", "now -12 degrees", "72 clips\n"]
    assert number_reward(None, last_number, answer=["1234", "-12", "72"], answer_format="last_number") == [1.0] * 3


@pytest.mark.parametrize("bad_line, problem", [
    ("{not json", "line 2"), ('["a list"]', "expected a JSON object"), ('{"question": "Q"}', "'answer'"),
    ('{"question": "Q", "answer": "no final line"}', "####"), ('{"question": "\xff"}', "utf-8"), ('{"question": "Q", "answer": "#### many"}', "many"),
])
def test_gsm8k_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    path = tmp_path / "broken.jsonl"
    path.write_bytes((json.dumps(GSM8K_EXAMPLES[0]) + "\n" + bad_line + "\n").encode("latin-1"))
    with pytest.raises(ValueError) as error:
        read_gsm8k(path)
    assert "broken.jsonl, line 2" in str(error.value) and problem in str(error.value)


def test_gsm8k_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        GSM8KTask(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no examples"):
        GSM8KTask(empty).sample(1)
    one = tmp_path / "one.jsonl"
    write_jsonl(one, GSM8K_EXAMPLES[:1])
    with pytest.raises(ValueError, match="n must be a whole number from 0 to 1"):
        GSM8KTask(one).sample(2)


# --- answer extraction and format ----------------------------------------------------------------------------------

def test_extract_and_parse():
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("<answer>2") is None and extract_answer("no tags") is None
    assert extract_answer("it is 1,234.", "last_number") == "1,234"
    assert parse_number("1,234") == 1234 and parse_number("-12") == -12 and parse_number("3.50") == Fraction(7, 2)
    assert parse_number("1e3") is None and parse_number("nan") is None and parse_number("9" * 5_000) is None


def test_format_reward():
    completions = ["think\n<answer>85</answer>", "<answer>85</answer> trailing", "<answer></answer>", "85",
                   "<answer>1</answer><answer>2</answer>"]
    assert format_reward(None, completions) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_chat_rows_and_chat_completions():
    rows = ArithmeticTask(seed=0).sample(2)
    chat_rows = to_chat(rows, system="Be brief.")
    assert [message["role"] for message in chat_rows[0]["prompt"]] == ["system", "user"]
    assert chat_rows[0]["prompt"][1]["content"] == rows[0]["prompt"] and isinstance(rows[0]["prompt"], str)
    completions = [[{"role": "assistant", "content": tagged(row["answer"])}] for row in rows]
    assert number_reward(None, completions, answer=[row["answer"] for row in rows]) == [1.0, 1.0]


# --- combining rewards ---------------------------------------------------------------------------------------------

def test_combine_rewards_weights_and_per_function_values():
    rewards = combine_rewards([(number_reward, 2.0), (format_reward, 0.25)])
    completions = [tagged("85"), "85", tagged("84")]
    scores = rewards.score(None, completions, answer=["85"] * 3)
    assert scores.per_function == {"number_reward": [1.0, 0.0, 0.0], "format_reward": [1.0, 0.0, 1.0]}
    assert scores.total == [2.25, 0.0, 0.25]
    assert rewards(None, completions, answer=["85"] * 3) == [2.25, 0.0, 0.25]
    assert rewards.__name__ == "combined_reward"
    assert scores.means()["rewards/number_reward"] == pytest.approx(1 / 3)
    same_twice = combine_rewards([(format_reward, 1.0), (format_reward, -1.0)])
    assert list(same_twice.functions) == ["format_reward", "format_reward_2"]
    assert same_twice(None, [tagged("1")]) == [0.0]


def test_task_rewards_default_weights():
    rows = ArithmeticTask(seed=4).sample(2)
    rewards = ArithmeticTask().rewards(format_weight=0.5)
    assert rewards(None, [tagged(rows[0]["answer"]), "wrong"], **columns_of(rows, "answer")) == [1.5, 0.0]


def test_raising_reward_is_counted_reported_and_scores_zero():
    def picky_reward(prompts, completions, **columns):
        return [1.0 if "ok" in completion else {}["missing"] for completion in completions]

    rewards = combine_rewards([(picky_reward, 1.0), (format_reward, 1.0)])
    long_bad = "bad " * 1_000 + tagged("1")
    with pytest.warns(RewardFunctionWarning) as caught:
        scores = rewards.score(None, ["ok " + tagged("1"), long_bad], answer=["1", "1"])
    assert scores.per_function["picky_reward"] == [1.0, 0.0]
    assert scores.total == [2.0, 1.0]
    assert rewards.error_counts == {"picky_reward": 1, "format_reward": 0} and rewards.error_count == 1
    message = str(caught[0].message)
    assert "picky_reward" in message and "KeyError" in message and "bad bad" in message
    assert len(message) < 500  # the completion is truncated


def test_reward_returning_garbage_is_counted():
    def wrong_length(prompts, completions, **columns): return [1.0]
    def not_finite(prompts, completions, **columns): return [math.inf] * len(completions)
    def not_applicable(prompts, completions, **columns): return [None] * len(completions)

    rewards = combine_rewards([(wrong_length, 1.0), (not_finite, 1.0), (not_applicable, 1.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardFunctionWarning)
        assert rewards(None, ["a", "b"]) == [1.0, 1.0]  # wrong_length works one completion at a time
        assert rewards.error_counts == {"wrong_length": 1, "not_finite": 2, "not_applicable": 0}


def test_combine_rewards_bad_inputs():
    with pytest.raises(ValueError, match="at least one"):
        combine_rewards([])
    with pytest.raises(TypeError, match="callable"):
        combine_rewards([("number_reward", 1.0)])
    for weight in [math.nan, "1", None, True]:
        with pytest.raises(ValueError, match="finite number"):
            combine_rewards([(number_reward, weight)])


# --- registry and knob errors --------------------------------------------------------------------------------------

def test_registry():
    assert sorted(TASKS) == ["arithmetic", "arithmetic_chain", "countdown", "gsm8k"]
    assert get_task("arithmetic", digits=4, operands=3) == ArithmeticTask(digits=4, operands=3)
    assert get_task("arithmetic").reward is number_reward and get_task("countdown").reward is countdown_reward
    with pytest.raises(ValueError, match=r"unknown task 'chess'; known tasks: \['arithmetic', 'arithmetic_chain'"):
        get_task("chess")
    with pytest.raises(ValueError, match=r"has no knob \['digit'\]; its knobs are \['digits'"):
        get_task("arithmetic", digit=3)
    with pytest.raises(ValueError, match=r"needs \['path'\]"):
        get_task("gsm8k")


@pytest.mark.parametrize("name, knobs, message", [
    ("arithmetic", {"digits": 0}, f"digits must be a whole number from 1 to {MAX_DIGITS}, got 0"),
    ("arithmetic", {"digits": MAX_DIGITS + 1}, "digits must be a whole number from 1"),
    ("arithmetic", {"digits": 2.5}, "digits must be a whole number"),
    ("arithmetic", {"operands": 1}, "operands must be a whole number from 2 to"),
    ("arithmetic", {"operators": "+/"}, "operators must be distinct characters from '+-*'"),
    ("arithmetic", {"operators": "++"}, "operators must be distinct characters"),
    ("arithmetic", {"answer_format": "xml"}, "answer_format must be one of ['tag', 'last_number']"),
    ("arithmetic", {"seed": "0"}, "seed must be a whole number"),
    ("arithmetic_chain", {"steps": 0}, "steps must be a whole number from 1 to"),
    ("countdown", {"count": 1}, "count must be a whole number from 2 to"),
    ("countdown", {"max_number": 0}, "max_number must be a whole number from 1 to"),
    ("countdown", {"max_target": 0}, "max_target must be a whole number from 1 to"),
    ("countdown", {"answer_format": "last_number"}, "answer_format must be one of ['tag', 'last_line']"),
])
def test_bad_knobs_say_what_is_wrong(name, knobs, message):
    with pytest.raises(ValueError) as error:
        get_task(name, **knobs)
    assert message in str(error.value)


def test_bad_sample_sizes():
    for n in [-1, 2.0, "3"]:
        with pytest.raises(ValueError, match="n must be a whole number"):
            ArithmeticTask().sample(n)
    assert ArithmeticTask().sample(0) == []


def test_gsm8k_bad_knobs(tmp_path):
    path = tmp_path / "g.jsonl"
    write_jsonl(path, GSM8K_EXAMPLES)
    with pytest.raises(ValueError, match="shuffle must be True or False"):
        GSM8KTask(path, shuffle="yes")
    with pytest.raises(ValueError, match="answer_format must be one of"):
        GSM8KTask(path, answer_format="last_line")


def test_chain_steps_reward_cannot_be_gamed_by_listing_numbers():
    "A completion that lists 0 1 ... 299 holds any increasing chain's results in order; it must earn no step credit."
    row = ArithmeticChainTask(steps=6, digits=1, operators="+", seed=3).sample(1)[0]
    assert all(int(a) < int(b) < 300 for a, b in zip(row["intermediate"], row["intermediate"][1:]))   # increasing
    assert int(row["intermediate"][0]) > 3                     # the listing is then over its bound before the first result
    listing = " ".join(str(n) for n in range(300))
    assert chain_steps_reward(None, [listing], intermediate=[row["intermediate"]]) == [0.0]
    worked, value = [], row["prompt"].split("Start with ")[1].split(".")[0]
    for result in row["intermediate"]:                         # "a + b = c" per line, as a worked solution writes it
        worked.append(f"Step {len(worked) + 1}: {value} + {int(result) - int(value)} = {result}"); value = result
    assert chain_steps_reward(None, ["\n".join(worked)], intermediate=[row["intermediate"]]) == [1.0]
