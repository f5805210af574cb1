"""The project's imports form a tree with hetero_gpt.py at its root: plumbing/ (what it uses)
never imports it back, tools/ (what extends it) is never imported by it, no module imports
itself through others, and `python hetero_gpt.py` loads the file once. Read with ast, lazy
imports inside functions included."""
import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
    if rel.startswith('tests.'):  # pytest puts tests/ (and the double's folder) on sys.path
        return rel.split('.')[-1]
    return rel.removesuffix('.__init__')


def project_modules():
    found = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(('.', '__', 'data', 'out'))]  # no venvs, caches, runs
        found |= {module_name(os.path.join(top, f)): os.path.join(top, f) for f in files if f.endswith('.py')}
    return found


def targets(node, name, modules):
    """The project modules an import statement in the module `name` names."""
    if isinstance(node, ast.Import):
        candidates = [a.name for a in node.names]
    else:
        base = node.module or ''
        if node.level:  # from . import x, from .x import y
            package = name.rsplit('.', node.level)[0] if '.' in name else ''
            base = '.'.join(filter(None, [package, node.module]))
        candidates = [f'{base}.{a.name}' for a in node.names] + [base]
    found = set()
    for c in candidates:
        while c and c not in modules:  # `import a.b.c`: the deepest project module named
            c = c.rpartition('.')[0]
        if c and c != name:
            found.add(c)
    return found


def imports(name, path, modules):
    """The project modules that the module `name` imports, anywhere in its file."""
    return {m for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, (ast.Import, ast.ImportFrom))
            for m in targets(node, name, modules)}


def graph():
    modules = project_modules()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def reachable(g, start):
    seen, todo = set(), list(g[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    return seen


def test_no_module_imports_itself_through_others():
    g = graph()
    cycles = sorted(m for m in g if m in reachable(g, m))
    assert not cycles, {m: sorted(g[m]) for m in cycles}


def test_hetero_gpt_is_the_root_of_what_it_uses():
    g = graph()
    used = reachable(g, 'hetero_gpt')
    # what it uses: the data file and the plumbing, nothing that extends it
    assert used == {'prepare_data'} | {m for m in g if m.startswith('plumbing')}, sorted(used)
    # the plumbing never imports it (nor anything that does)
    assert all('hetero_gpt' not in reachable(g, m) for m in used)
    # what extends it imports it
    for m in ('export_ane', 'bench', 'test_grads', 'tools.fast_standin', 'tools.ane_check', 'tools.compare'):
        assert m not in g or 'hetero_gpt' in g[m], m  # (the copy without the fast path lacks one)


def listed(comment):
    """The names in a `# defines: a (what a is), b, c` comment, or None where there is no list."""
    if 'defines:' not in comment:
        return None
    items = re.sub(r'\([^)]*\)', '', comment.split('defines:', 1)[1]).split(',')  # descriptions out
    return [item.strip() for item in items if item.strip()]


def brought(node, tree, modules):
    """What one import statement of hetero_gpt.py brings: `m.attr` for each attr the file uses of a
    project module m it binds, and each name it binds from a module (used or not)."""
    base = node.module if isinstance(node, ast.ImportFrom) else ''
    bound = {a.asname or a.name.split('.')[0]: '.'.join(filter(None, [base, a.name])) for a in node.names}
    uses = {name for name, full in bound.items() if full not in modules}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and bound.get(n.value.id) in modules:
            uses.add(f'{n.value.id}.{n.attr}')
    return uses


def test_each_project_import_of_the_reference_says_what_it_brings():
    # llm.c's `#include "llmc/dataloader.h"  // defines: ...`: every import of a project module in
    # hetero_gpt.py lists, after `defines:`, exactly the names the file uses from it
    source = open(os.path.join(ROOT, 'hetero_gpt.py')).read()
    lines, tree, modules = source.split('\n'), ast.parse(source), project_modules()
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and targets(node, 'hetero_gpt', modules):
            where = f'hetero_gpt.py:{node.lineno} `{ast.unparse(node)}`'
            end = node.end_lineno
            while end < len(lines) and lines[end].startswith('#   '):  # a list continued below
                end += 1
            names = listed(' '.join(lines[node.lineno - 1:end]).partition('#')[2].replace('#   ', ''))
            if names is None:
                wrong.append(f'{where} has no `# defines: ...` comment')
                continue
            uses = brought(node, tree, modules)
            add = sorted(u.rpartition('.')[2] for u in uses if u.rpartition('.')[2] not in names)
            remove = [n for n in names if n not in {u.rpartition('.')[2] for u in uses}]
            if add:
                wrong.append(f'{where}: add to its defines: {", ".join(add)} (brought here, not listed)')
            if remove:
                wrong.append(f'{where}: remove from its defines: {", ".join(remove)} (listed, never used)')
            unused = sorted(u for u in uses if '.' not in u and not any(
                isinstance(n, ast.Name) and n.id == u for n in ast.walk(tree)))
            if unused:
                wrong.append(f'{where}: imports {", ".join(unused)}, never used: drop from the import')
    assert not wrong, '\n'.join(wrong)


def test_the_trainer_runs_its_file_once():
    # `python hetero_gpt.py` is __main__; nothing imports it again as hetero_gpt
    r = subprocess.run([sys.executable, '-X', 'importtime', 'hetero_gpt.py', '--help'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = [line.rsplit('|', 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith('import time:')]
    assert 'plumbing.settings' in loaded and 'hetero_gpt' not in loaded


def test_the_test_requirements_fit_each_python_and_macos_a_user_may_have():
    # MLX 0.32 has wheels for Python 3.10+ on macOS 14+ (Darwin 23) and Linux; wandb 0.31 for
    # Python 3.10+: elsewhere the test command installs, and the suite requires, the rest
    from conftest import required_here
    base = {'pytest', 'pytest-xdist', 'transformers', 'matplotlib'}
    mac = dict(sys_platform='darwin', platform_machine='arm64', platform_release='24.1.0')
    assert set(required_here(dict(mac, python_version='3.9'))) == base
    assert set(required_here(dict(mac, python_version='3.12', platform_release='22.6.0'))) == base | {'wandb'}
    assert set(required_here(dict(mac, python_version='3.12'))) == base | {'wandb', 'mlx'}
    intel = dict(mac, platform_machine='x86_64', python_version='3.12')
    assert set(required_here(intel)) == base | {'wandb'}
    linux = dict(sys_platform='linux', platform_machine='x86_64', platform_release='6.1.0-18-amd64')
    assert set(required_here(dict(linux, python_version='3.11'))) == base | {'wandb', 'mlx'}
