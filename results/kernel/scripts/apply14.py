"""Patch tuned lead configs (tune14.py json files) into a copy of routing_kernel.py. usage: apply14.py DST.py JSON..."""
import sys, ast, re
dst = sys.argv[1]; s = open(dst).read()
for f in sys.argv[2:]:
    import json
    for key, cfg in json.load(open(f)).items():
        key = ast.literal_eval(key)
        m = re.search(r"^    %s: \{(.*?)\},$" % re.escape(repr(key)), s, flags=re.M)
        assert m, key
        body = m.group(1) + "".join(f', "{k}": {tuple(v) if v else None}' for k, v in cfg.items())
        s = s[:m.start()] + f"    {key!r}: {{{body}}}," + s[m.end():]
open(dst, "w").write(s)
print(re.search(r"^SHAPE_CONFIG = \{\n.*?\n\}\n", s, flags=re.S | re.M).group(0))
