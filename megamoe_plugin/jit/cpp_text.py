"""What of a C++ source the compiler sees, for the kernel cache's key: the text without comments
and with its whitespace normalized, so that a change to a comment or to the layout of the code
does not invalidate every user's cached kernels.

It follows the preprocessor's own rules, so that two texts with the same result compile alike:
a comment outside a string or character literal is one space (translation phase 3; a `//`
comment goes on past a line that ends in a backslash); a run of spaces and tabs is one space;
blank lines and the blanks at either end of a line go. Newlines stay, since they end preprocessor
directives, and so do literals, byte for byte. (A digit separator, 1'000, would read as a
character literal; the kernel sources have none.)
"""
import re

# A string or character literal (with its escapes), a comment, code up to the next of these, or
# one character that starts none of them (a lone quote or slash).
_TOKEN = re.compile(r'''("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|//(?:\\\n|[^\n])*|/\*.*?\*/|[^"'/]+|.''', re.S)
_BLANKS = re.compile(r"[ \t\f\v]+")


def code_only(text: str) -> str:
    """`text` without its comments, with each line's blanks normalized and blank lines dropped."""
    parts, code = [], []
    for match in _TOKEN.finditer(text):
        token, literal = match.group(), match.group(1)
        if literal is None:
            code.append(" " if token.startswith(("//", "/*")) else token)
            continue
        parts.append(_BLANKS.sub(" ", "".join(code)))
        parts.append(literal)
        code = []
    parts.append(_BLANKS.sub(" ", "".join(code)))
    lines = (line.strip() for line in "".join(parts).split("\n"))
    return "\n".join(line for line in lines if line)
