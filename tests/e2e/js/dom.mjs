// The few DOM calls the page's pure modules make, for running them under node: elements that keep
// their children, text and attributes. Enough to read the tree back, not a browser.

class Node {
  constructor(tag) {
    this.tagName = tag;
    this.childNodes = [];
    this.style = {};
    this.dataset = {};
    this.attributes = {};
    this.className = "";
  }

  append(...nodes) {
    for (const n of nodes) this.childNodes.push(typeof n === "string" ? new Text(n) : n);
  }

  replaceChildren(...nodes) {
    this.childNodes = [];
    this.append(...nodes);
  }

  setAttribute(name, value) {
    this.attributes[name] = String(value);
  }

  get textContent() {
    return this.childNodes.map((n) => n.textContent).join("");
  }

  set textContent(text) {
    this.childNodes = text === "" ? [] : [new Text(text)];
  }
}

class Text {
  constructor(data) {
    this.data = data;
  }

  get textContent() {
    return this.data;
  }
}

globalThis.document = {
  createElement: (tag) => new Node(tag),
  createDocumentFragment: () => new Node("#fragment"),
  createTextNode: (data) => new Text(data),
};

/** The element names in a rendered tree, depth first, for checking what was built. */
export function tags(node, out = []) {
  if (node.tagName && node.tagName !== "#fragment") out.push(node.tagName);
  for (const child of node.childNodes || []) tags(child, out);
  return out;
}
