"""What the tests of every command-line tool check about its --help."""


def assert_help_describes(proc, parser) -> None:
    """`proc` (the tool run with --help) succeeded and printed the parser's description and every
    option, and every option has help text."""
    assert proc.returncode == 0, proc.stderr
    assert parser.description.splitlines()[0] in proc.stdout
    for action in parser._actions:
        assert action.help, action.dest
        assert action.option_strings[-1] in proc.stdout
