"""Output that claims to be a terminal, and a clock tests step by hand: for progress reporting."""

import io


class Terminal(io.StringIO):
    """A StringIO that says it is a terminal, as a user's shell would (``call_command(stdout=Terminal())``)."""

    def isatty(self):
        return True

    def lines(self):
        """What a terminal would show: each ``\\r`` returns to the start of the line, which the next text overwrites."""
        shown = []
        for line in self.getvalue().split("\n"):
            screen = ""
            for part in line.split("\r"):
                screen = part + screen[len(part) :]
            shown.append(screen.rstrip())
        return shown


class SteppedClock:
    """A monotonic clock that moves only when told (or by ``step`` on every reading, with ``auto``)."""

    def __init__(self, start=1000.0, auto=0.0):
        self.now = start
        self.auto = auto

    def __call__(self):
        now = self.now
        self.now += self.auto
        return now

    def advance(self, seconds):
        self.now += seconds
