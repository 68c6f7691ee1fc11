"""
Every script's options as kinds with ranges, and the one checker that reads them. An option's kind stands where the
option is defined (train.py's in configurator.py's fields, every other script's in its add_argument calls); the
checker refuses a value outside it in one line naming the option, the value and the rule, before any work and before
anything is written. A value a library would clamp or reject is refused here, with its limit named.

  Count(lo, hi)     a whole number in [lo, hi] (1e9 and 100_000_000 read as whole numbers); hi is what the option's
                    use can hold, not "any integer"
  Real(lo, hi)      a finite number in a range, each end open or closed
  Choice(*names)    one of the names
  Flag()            True or False
  Seed()            a whole number both torch.manual_seed and numpy's generators take: [0, 2^64 - 1]
  Path(kind)        "file" / "dir" / "any": one that exists; "out_file" / "out_dir": one to write, not a path of the
                    other kind, whose nearest existing folder is writable, and which holds nothing but the artifact
                    kind the option declares it writes (writes=, common.ARTIFACTS: the write guard). Resolved against
                    the working directory
  Names(*known)     a comma-separated, non-empty list of known names
  Counts(lo, hi)    a comma-separated, non-empty list of whole numbers in [lo, hi]
  Text(empty=False) text; empty only where that means something
  Mapping()         a {key: value} table (a config file's)
  Either(a, b, ..)  the first rule that takes the value (e.g. "scratch" or a folder)
  Maybe(rule)       None (the option's default: not given) or the rule

Parser is argparse's parser with this module's one-line errors. The standard library only; it imports no other file
of the repository.
"""
import argparse
import math
import os
import re


class Rule:
    """A kind of value. convert(text) reads a command-line value, check(value) a typed one (a config file's); both
    return the value the program uses or raise ValueError(the rule in words). argparse calls a rule as its type."""

    def describe(self):
        raise NotImplementedError

    def check(self, value):
        raise NotImplementedError

    def convert(self, text):
        return self.check(text)

    def __call__(self, text):   # argparse's type=: one error class, the rule's words
        try:
            return self.convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"={text} {e}") from None

    def refuse(self):
        raise ValueError(f"must be {self.describe()}")

    def __repr__(self):
        return self.describe()


def _number(text):
    """A command-line number: int or float, underscores allowed (100_000_000), nan / inf as floats; else None."""
    text = str(text).strip().replace("_", "")
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def _bound(x):
    return f"2^{x.bit_length()} - 1" if isinstance(x, int) and x > 2**20 and (x + 1) & x == 0 else f"{x:,}" \
        if isinstance(x, int) else f"{x:g}"


class Count(Rule):
    def __init__(self, lo, hi, unit=""):
        self.lo, self.hi, self.unit = lo, hi, unit

    def describe(self):
        return f"a whole number in [{_bound(self.lo)}, {_bound(self.hi)}]" + (f" ({self.unit})" if self.unit else "")

    def convert(self, text):
        value = _number(text)
        return self.check(value if value is not None else text)

    def check(self, value):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**63:
            value = int(value)   # 1e9: a whole number written as a float
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            self.refuse()
        return value


class Seed(Count):
    def __init__(self):
        super().__init__(0, 2**64 - 1, "torch.manual_seed takes [-2^63, 2^64 - 1], numpy's generators no negative")


class Real(Rule):
    def __init__(self, lo=None, hi=None, lo_open=False, hi_open=False, note=""):
        self.lo, self.hi, self.lo_open, self.hi_open, self.note = lo, hi, lo_open, hi_open, note

    def describe(self):
        if self.lo is not None and self.hi is not None:
            where = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            where = f"{'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            where = f"{'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            where = ""
        return f"a finite number {where}".rstrip() + (f" ({self.note})" if self.note else "")

    def convert(self, text):
        value = _number(text)
        return self.check(value if value is not None else text)

    def check(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.refuse()
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            self.refuse()
        if self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)):
            self.refuse()
        return float(value)


class Choice(Rule):
    def __init__(self, *names):
        self.names = names

    def describe(self):
        return "one of " + ", ".join(map(str, self.names))

    def convert(self, text):
        return self.check(text)

    def check(self, value):
        if isinstance(value, bool) or value not in self.names:
            self.refuse()
        return value


class Flag(Rule):
    def describe(self):
        return "True or False"

    def convert(self, text):
        if str(text) not in ("True", "False"):
            self.refuse()
        return text == "True"

    def check(self, value):
        if not isinstance(value, bool):
            self.refuse()
        return value


class Text(Rule):
    def __init__(self, empty=False, what="text"):
        self.empty, self.what = empty, what

    def describe(self):
        return self.what if self.empty else f"{self.what}, not empty"

    def check(self, value):
        if not isinstance(value, str) or not (value or self.empty) or "\x00" in value:
            self.refuse()
        return value


class Path(Rule):
    KINDS = {"file": "an existing file", "dir": "an existing folder", "any": "an existing file or folder",
             "out_file": "a file to write (not a folder; in a folder that exists or can be made, writable)",
             "out_dir": "a folder to write (not a file; where a folder can be made, writable)"}

    def __init__(self, kind, what="", absolute=True, writes=None):
        assert kind in self.KINDS, kind
        assert (writes is not None) == kind.startswith("out_"), "an output path declares what it writes"
        self.kind, self.what, self.absolute = kind, what, absolute   # absolute: return it resolved (else as given)
        self.writes = writes   # out_*: the kind of artifact written there (common.ARTIFACTS), the write guard's

    def describe(self):
        return self.KINDS[self.kind] + (f": {self.what}" if self.what else "")

    def check(self, value):
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            self.refuse()
        path = os.path.abspath(os.path.expanduser(value))   # resolved against the working directory, once
        if self.kind in ("file", "dir", "any"):
            ok = {"file": os.path.isfile, "dir": os.path.isdir, "any": os.path.exists}[self.kind](path)
            if not ok:
                raise ValueError(("does not exist" if not os.path.exists(path) else "is a folder" if os.path.isdir(path)
                                  else "is not a folder") + f": it must be {self.describe()}")
            return path if self.absolute else value
        wrong = os.path.isdir if self.kind == "out_file" else (lambda p: os.path.exists(p) and not os.path.isdir(p))
        if wrong(path):
            raise ValueError(f"is {'a folder' if os.path.isdir(path) else 'a file'}: it must be {self.describe()}")
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"cannot be written: {parent} is {'not a folder' if not os.path.isdir(parent) else 'not writable'}"
                             f" (read-only, or another user's); it must be {self.describe()}")
        from common import check_target   # the write guard: what is there must be what this option writes
        check_target(path, self.writes, self.kind == "out_dir")
        return path if self.absolute else value


class Mapping(Rule):
    def describe(self):
        return "a {key: value} table"

    def check(self, value):
        if not isinstance(value, dict):
            self.refuse()
        return value


class Names(Rule):
    def __init__(self, *known):
        self.known = known

    def describe(self):
        return "one or more of " + ",".join(self.known) + ", comma-separated"

    def check(self, value):
        names = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else None
        if not names or any(n not in self.known for n in names):
            self.refuse()
        return list(dict.fromkeys(names))


class Counts(Rule):
    def __init__(self, lo, hi):
        self.each = Count(lo, hi)

    def describe(self):
        return f"one or more whole numbers in [{_bound(self.each.lo)}, {_bound(self.each.hi)}], comma-separated"

    def check(self, value):
        parts = [v.strip() for v in value.split(",")] if isinstance(value, str) else None
        try:
            return [self.each.convert(v) for v in parts] if parts and all(parts) else self.refuse()
        except ValueError:
            self.refuse()


class Either(Rule):
    def __init__(self, *rules):
        self.rules = rules

    def describe(self):
        return " or ".join(r.describe() for r in self.rules)

    def _first(self, method, value):
        for rule in self.rules:
            try:
                return getattr(rule, method)(value)
            except ValueError:
                continue
        self.refuse()

    def convert(self, text):
        return self._first("convert", text)

    def check(self, value):
        return self._first("check", value)


class Maybe(Rule):
    """None (not given: the option's own default applies) or the rule."""

    def __init__(self, rule):
        self.rule = rule

    def describe(self):
        return self.rule.describe() + " (or not given)"

    def convert(self, text):
        return self.rule.convert(text)

    def check(self, value):
        return None if value is None else self.rule.check(value)


class Device(Rule):
    """cpu, cuda or cuda:N (auto too where allowed), and CUDA there (common.check_device)."""

    def __init__(self, auto=False):
        self.auto = auto

    def describe(self):
        return ("auto, " if self.auto else "") + "cpu, cuda or cuda:N"

    def check(self, value):
        if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d{1,4})?" + ("|auto" if self.auto else ""), value):
            self.refuse()
        if value != "auto":
            from common import check_device
            try:
                check_device(value)
            except ValueError as e:   # (its message names the option; this rule's caller does too)
                raise ValueError(str(e).split(" ", 1)[1]) from None
        return value


def rule_of(action):
    """The rule an argparse option carries (its type), or the rule its choices and action imply."""
    if isinstance(action.type, Rule):
        return action.type
    if action.choices is not None:
        return Choice(*action.choices)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return Flag()
    return None


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: "PROG: error: --name=value must be RULE" (and argparse's own, on one line), exit
    status 2, nothing else printed."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        message = re.sub(r"^argument (--[\w-]+)(?:/[\w-]+)?: =", r"\1=", message)
        message = re.sub(r"^argument (--[\w-]+)(?:/[\w-]+)?: ", r"\1: ", message)
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")
