"""kvtrace.dashboard: the Streamlit dashboard — where each request's time to first token went.

``kvtrace dashboard --db PATH`` serves it (:mod:`.launch`). ``app.py`` is the entrypoint and
navigation, ``app_pages/`` one page per question, :mod:`.data` the only way to the store (through
:mod:`kvtrace.collectors.read`), :mod:`.charts` Plotly figure builders, :mod:`.ui` what every
page shares (filters in the sidebar and the URL, empty and error states).
"""
