"""Each command shows and accepts the strategy options it reads (jaxpar.core.strategy.Options: each field's
`commands`), grouped by concern in its --help, and answers an option it does not take in one line that
names the commands that do."""
import argparse

import pytest

from jaxpar.cli import main as cli
from jaxpar.core.strategy import EVERY, GROUPS, OPTION_FIELDS, options_of


def strategy_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{flag: its group's title} of the strategy flags a parser offers."""
    out = {}
    for group in parser._action_groups:  # noqa: SLF001
        if group.title and group.title.startswith("strategy flags"):
            out |= {a.option_strings[0]: group.title for a in group._group_actions}  # noqa: SLF001
    return out


def test_each_command_offers_the_options_it_reads_grouped_by_concern():
    parser = cli.build_parser()
    for command in EVERY:
        offered = strategy_flags(parser.commands[command])
        want = {"--" + f.name.replace("_", "-"): f.metadata["group"] for f in options_of(command)}
        assert set(offered) == set(want), command
        assert all(title.startswith(f"strategy flags: {want[flag]} ") for flag, title in offered.items()), command
    assert set(strategy_flags(parser.commands["estimate"])) == {"--" + f.name.replace("_", "-") for f in OPTION_FIELDS}
    assert {f.metadata["group"] for f in OPTION_FIELDS} == set(GROUPS)
    # generate shows no training flag; train no estimate-only one
    assert not {"--remat", "--grad-accum", "--microbatches", "--overlap", "--fsdp-prefetch"} & set(
        strategy_flags(parser.commands["generate"]))
    assert "--grad-dtype" not in strategy_flags(parser.commands["train"])


@pytest.mark.parametrize("argv, words", [
    (["generate", "--model", "llama-tiny", "--mesh", "dp8", "--prompt", "1,2", "--remat", "full"],
     "generate: --remat is not an option of generate: it shapes what train, comm, compare, estimate, explain run"),
    (["generate", "--model", "llama-tiny", "--mesh", "dp8", "--prompt", "1,2", "--no-sequence-parallel"],
     "--no-sequence-parallel is not an option of generate"),
    (["train", "--model", "llama-tiny", "--mesh", "dp8", "--grad-dtype", "bfloat16"],
     "train: --grad-dtype is not an option of train: it shapes what estimate runs"),
])
def test_an_option_a_command_does_not_take_is_one_clear_line(argv, words, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
