from kvtrace.cli import main

raise SystemExit(main())
