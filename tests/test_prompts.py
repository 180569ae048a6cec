"""kohya sample-prompt syntax."""

from pathlib import Path

import pytest

from tasks.data.prompts import PromptLineError, SamplePrompt, parse_prompt_line, read_prompts

REPO = Path(__file__).resolve().parents[1]


def test_example_lines_parse():
    assert parse_prompt_line("a red circle on a blue background --w 64 --h 64 --d 1 --s 4", 2) == SamplePrompt(
        line=2, prompt="a red circle on a blue background", width=64, height=64, seed=1, steps=4)
    p = parse_prompt_line("a green square on a yellow background --n blurry --w 64 --h 64 --d 2 --s 4", 3)
    assert (p.prompt, p.negative, p.width, p.seed) == ("a green square on a yellow background", "blurry", 64, 2)
    p = parse_prompt_line("a blue triangle on a striped background --w 64 --h 64 --d 3 --s 4 --l 3.5", 4)
    assert p.guidance == 3.5 and p.true_cfg is None and p.steps == 4


def test_all_options_and_case_insensitive():
    p = parse_prompt_line("  a cat, photo  --N ugly, low quality --W 512 --H 768 --S 20 --L 7 --G 1.5 --D 0  ", 7)
    assert p == SamplePrompt(7, "a cat, photo", "ugly, low quality", 512, 768, 20, 7.0, 1.5, 0)


@pytest.mark.parametrize("text", ["", "   ", "# comment --w abc", "  # indented comment"])
def test_blank_and_comment_lines(text):
    assert parse_prompt_line(text, 1) is None


@pytest.mark.parametrize("text, option, needle", [
    ("a cat --w abc", "w", "integer"),
    ("a cat --x 1", "x", "unknown option --x"),
    ("a cat --h 0", "h", "positive"),
    ("a cat --s -3", "s", "positive"),
    ("a cat --w 1.5", "w", "integer"),
    ("a cat --l high", "l", "number"),
    ("a cat --g nan", "g", "finite"),
    ("a cat --d", "d", "needs a value"),
    ("a cat --w 64 --w 32", "w", "more than once"),
])
def test_bad_options_name_line_and_option(text, option, needle):
    with pytest.raises(PromptLineError) as e:
        parse_prompt_line(text, 9)
    msg = str(e.value)
    assert msg.startswith("line 9:") and f"--{option}" in msg and needle in msg
    assert e.value.line == 9 and e.value.option == option


@pytest.mark.parametrize("text", ["--w 64 --h 64", "   --n bad", " --s 4"])
def test_empty_prompt_is_an_error(text):
    with pytest.raises(PromptLineError, match=r"line 5: empty prompt"):
        parse_prompt_line(text, 5)


def test_read_prompts_skips_bad_lines_with_warnings(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbf# header\r\n"
                     b"a dog --w 64\r\n"
                     b"\r\n"
                     b"a cat --w abc\n"
                     b"caf\xe9 --s 2\n"
                     b"--x 1\n"
                     b"a bird --x 1\n"
                     b"a fish --d 7")
    prompts, warnings = read_prompts(path)
    assert [(p.line, p.prompt) for p in prompts] == [(2, "a dog"), (8, "a fish")]
    assert len(warnings) == 4
    assert warnings[0].startswith(f"{path}:4: ") and "--w" in warnings[0]
    assert warnings[1].startswith(f"{path}:5: ") and "UTF-8" in warnings[1]
    assert warnings[2].startswith(f"{path}:6: ") and "empty prompt" in warnings[2]
    assert warnings[3].startswith(f"{path}:7: ") and "--x" in warnings[3]


def test_missing_file_names_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"sample\.prompts_file"):
        read_prompts(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=r"sample\.prompts_file.*not a file"):
        read_prompts(tmp_path)


def test_committed_demo_prompts_parse_cleanly():
    prompts, warnings = read_prompts(REPO / "data" / "demo_prompts.txt")
    assert warnings == []
    assert [(p.line, p.width, p.height, p.seed, p.steps) for p in prompts] == [
        (4, None, None, None, None), (5, None, None, None, None), (6, 64, 64, None, None)]
    assert prompts[1].negative == "blurry" and prompts[0].negative == ""
