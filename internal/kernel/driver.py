# kiln's Python kernel driver. It runs inside the sandbox, started by
# kiln-agent. Requests arrive as JSON lines on fd 3; each answer is one JSON
# line on fd 4, naming the cell it answers. The cell's stdout and stderr are
# the process's own fds 1 and 2, read by the agent, which marks where a
# cell's output starts and ends itself: this process is the cell's, so
# nothing it knows could mark that unforgeably.
import ast
import base64
import builtins
import json
import linecache
import os
import sys
import traceback

_REQ = None  # fd 3, opened by serve()
_RES = None  # fd 4
_MAX_REPR = 8 << 20  # one representation; bigger ones are dropped with a note
_MAX_DISPLAYS = 64
_MAX_RICH = 4 << 20  # all representations of one cell together (agentproto.MaxRich)
_DRIVER_FILE = "<kiln-driver>"

_displays = []
_cell_count = 0
_rich_used = 0  # bytes of representations kept in this cell

_TEXT_REPRS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
]
_BINARY_REPRS = [
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
]


def _is_figure(obj):
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


def _figure_png(fig):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _put(bundle, mime, value):
    if value is None:
        return
    if isinstance(value, tuple):  # (data, metadata)
        value = value[0]
    if isinstance(value, (bytes, bytearray)):
        value = base64.b64encode(bytes(value)).decode("ascii")
    elif mime == "application/json" and not isinstance(value, str):
        value = json.dumps(value, default=str)
    elif not isinstance(value, str):
        value = str(value)
    global _rich_used
    size = len(value) if value.isascii() else len(value.encode("utf-8", "replace"))
    if len(value) > _MAX_REPR:
        bundle.setdefault("text/x-kiln-note", "")
        bundle["text/x-kiln-note"] += "%s representation dropped: %d bytes is over the cap\n" % (mime, len(value))
        return
    if _rich_used + size > _MAX_RICH:
        bundle.setdefault("text/x-kiln-note", "")
        bundle["text/x-kiln-note"] += "%s representation dropped: %d bytes would take the rich output of this call over %d MiB\n" % (mime, size, _MAX_RICH >> 20)
        return
    _rich_used += size
    bundle[mime] = value


def mimebundle(obj):
    """The display representations of obj, as Jupyter computes them."""
    bundle = {}
    if _is_figure(obj):
        _put(bundle, "image/png", _figure_png(obj))
        try:
            import matplotlib.pyplot as plt

            plt.close(obj)
        except Exception:
            pass
        bundle["text/plain"] = repr(obj)
        return bundle
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method) and not isinstance(obj, type):
        try:
            data = method()
            if isinstance(data, tuple):
                data = data[0]
            for mime, value in (data or {}).items():
                _put(bundle, mime, value)
        except Exception:
            pass
    if not isinstance(obj, type):
        for mime, name in _BINARY_REPRS + _TEXT_REPRS:
            if mime in bundle:
                continue
            method = getattr(obj, name, None)
            if callable(method):
                try:
                    _put(bundle, mime, method())
                except Exception:
                    pass
    if "text/plain" not in bundle:
        try:
            _put(bundle, "text/plain", repr(obj))
        except Exception as e:
            bundle["text/plain"] = "<repr failed: %s: %s>" % (type(e).__name__, e)
    return bundle


def display(*objs, **kwargs):
    """Show objects in the tool result, like IPython's display()."""
    for obj in objs:
        if len(_displays) >= _MAX_DISPLAYS:
            return
        if kwargs.get("raw") and isinstance(obj, dict):
            bundle = {}
            for mime, value in obj.items():
                _put(bundle, mime, value)
        else:
            bundle = mimebundle(obj)
        _displays.append(bundle)


class _Image:
    """IPython.display.Image's small cousin: display(Image(filename=…))."""

    def __init__(self, data=None, filename=None, format="png"):
        if filename is not None:
            with open(filename, "rb") as f:
                data = f.read()
            if filename.lower().endswith((".jpg", ".jpeg")):
                format = "jpeg"
        self.data, self.format = data, format

    def _repr_mimebundle_(self):
        return {"image/" + self.format: self.data, "text/plain": "<Image %s, %d bytes>" % (self.format, len(self.data or b""))}


class _HTML:
    def __init__(self, data):
        self.data = data

    def _repr_html_(self):
        return self.data

    def __repr__(self):
        return "<HTML>"


class _Markdown:
    def __init__(self, data):
        self.data = data

    def _repr_markdown_(self):
        return self.data

    def __repr__(self):
        return self.data


def _capture_figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        if len(_displays) < _MAX_DISPLAYS:
            try:
                _displays.append({"image/png": _figure_png(fig), "text/plain": repr(fig)})
            except Exception as e:
                _displays.append({"text/plain": "<figure could not be rendered: %s>" % e})
        plt.close(fig)


def _show(*args, **kwargs):
    _capture_figures()


def _setup_matplotlib():
    # matplotlib takes its backend from MPLBACKEND when it is imported, so
    # a kernel that does not preload it leaves the import (0.1-0.5 s) to
    # the first cell that needs it; one that preloads it imports it with
    # Agg already chosen.
    os.environ["MPLBACKEND"] = "Agg"


def _patch_pyplot():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None and plt.show is not _show:
        plt.show = _show


def _user_frames(tb):
    # Drop the driver's own frames so the traceback starts in the cell.
    while tb is not None and tb.tb_frame.f_code.co_filename in (_DRIVER_FILE, "<string>"):
        tb = tb.tb_next
    return tb


def _format_error(e):
    if isinstance(e, SyntaxError):
        lines = traceback.format_exception_only(type(e), e)
    else:
        lines = traceback.format_exception(type(e), e, _user_frames(e.__traceback__))
    return {"ename": type(e).__name__, "evalue": str(e), "traceback": "".join(lines)}


def _run_cell(code, ns):
    global _cell_count
    _cell_count += 1
    filename = "<cell %d>" % _cell_count
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    result, error, interrupted = None, None, False
    try:
        tree = ast.parse(code, filename=filename, mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        _patch_pyplot()
        if last is not None:
            value = eval(compile(last, filename, "eval"), ns)
            _patch_pyplot()
            if value is not None:
                ns["_"] = value
                result = mimebundle(value)
    except KeyboardInterrupt as e:
        interrupted = True
        error = _format_error(e)
    except SystemExit as e:
        error = {"ename": "SystemExit", "evalue": str(e.code), "traceback": "SystemExit: %s\n" % (e.code,)}
    except BaseException as e:
        error = _format_error(e)
    try:
        _capture_figures()
    except KeyboardInterrupt:
        interrupted = True
    return result, error, interrupted


def _send(obj):
    _RES.write((json.dumps(obj) + "\n").encode())


def prepare():
    """Import the preloaded modules and install display(); returns their names."""
    _setup_matplotlib()
    preloaded = []
    for name in [m for m in os.environ.pop("KILN_PRELOAD", "").split(",") if m]:
        try:
            __import__(name)
            preloaded.append(name)
        except Exception:
            pass
    if "matplotlib" in preloaded:
        try:
            import matplotlib.pyplot  # noqa: F401

            _patch_pyplot()
        except Exception:
            pass
    builtins.display = display
    # The cell namespace is __main__'s, so classes defined in cells pickle.
    ns = sys.modules["__main__"].__dict__
    ns.update({"display": display, "Image": _Image, "HTML": _HTML, "Markdown": _Markdown})
    return preloaded


def serve(preloaded):
    """Say ready on fd 4, then run the cells that arrive on fd 3 until EOF."""
    global _REQ, _RES, _rich_used
    # Children the cells start (os.system, a shell) get neither.
    os.set_inheritable(3, False)
    os.set_inheritable(4, False)
    _REQ = os.fdopen(3, "rb", buffering=0)
    _RES = os.fdopen(4, "wb", buffering=0)
    ns = sys.modules["__main__"].__dict__
    _send({"ready": True, "python": sys.version.split()[0], "preloaded": preloaded})
    buf = b""
    while True:
        try:
            chunk = _REQ.read(1 << 16)
        except KeyboardInterrupt:
            continue
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
                code, cell = req["code"], req["cell"]
            except (ValueError, TypeError, KeyError):
                continue
            _displays.clear()
            _rich_used = 0
            result, error, interrupted = None, None, False
            try:
                result, error, interrupted = _run_cell(code, ns)
            except KeyboardInterrupt:
                interrupted = True
            displays = list(_displays)
            _displays.clear()
            # The cell's output is in the pipes before the answer is.
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            _send({"cell": cell, "result": result, "displays": displays, "error": error, "interrupted": interrupted})


def main():
    serve(prepare())


# A jail zygote passes its fork server in KILN_ZYGOTE (zygote.py): it runs
# prepare() once and serve() in every box it forks.
_ZYGOTE = os.environ.pop("KILN_ZYGOTE", "")
if _ZYGOTE:
    exec(compile(_ZYGOTE, "<kiln-zygote>", "exec"), globals())
    del _ZYGOTE
    zygote_main()
else:
    del _ZYGOTE
    main()
